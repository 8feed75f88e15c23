"""MHA/GQA -> multi-head latent attention (MLA): a training-free, calibrated conversion into a vanilla `deepseek_v3`
checkpoint (dense MLP in every layer) that `AutoModelForCausalLM.from_pretrained` loads without remote code.

Per layer (H query heads, G KV heads, head dim D, rotary dims rd in rotate_half pairs (f, f + rd/2)):
1. RoRoPE (TransMLA, Meng et al. 2025): per kept rotary frequency f the G key planes, read as complex numbers
   z_g = k_{g,f} + i k_{g,f+rd/2}, are mixed by a unitary matrix across heads. A position rotation multiplies every
   z_g by the same e^{i theta}, so the mixing commutes with RoPE (exact). The top component w = sum_g conj(c_g) z_g
   (query-weighted PCA of the Hermitian key Gram) becomes the one shared rotary key; query head h reads it with
   q_rope = conj(a_g) q_{h,f}, z_g ~ a_g w. Kept frequencies are every n-th (n = rd / rope_dim): exactly the
   source's RoPE at dim rope_dim with the same theta (llama3 and yarn scaling too: `mla_rope_parameters`, whose
   magnitude, yarn's attention factor, is folded into the query rows). A layer with a RoPE of its own (Gemma 3's
   sliding layers) keeps, per target pair, its pair of nearest frequency (headlab.kv.layer_rope). The residual z_g - a_g w and every frequency
   not kept lose RoPE: THE
   approximation, softened by counting those key parts with their mean rotation under each head's calibration
   attention (rope_phases: the least-squares position-free stand-in). q_nope_h = conj(c_h) q_h (D dims), k_nope_g =
   the residual key (D dims).
2. Latent: [k_nope; v] (2GD rows, a linear map A of the layer input x) is reduced-rank regressed onto kv_lora_rank
   latent dims under a metric B = blockdiag(beta * sum_h E[q_h q_h^T], sum_h W_o[h]^T W_o[h]) (query-aware keys,
   output-aware values; beta balances the two: equal relative energy times the plan's key weight, measured along
   with the split when the split is measured), calibrated on the input Gram Sigma = E[x x^T]:
   latent = U^T B^{1/2} A, decode = B^{-1/2} U, U = top eigenvectors of B^{1/2} A Sigma A^T B^{1/2}. Exact at
   full rank (2GD - rope_dim). Each latent dim is then scaled to unit calibration mean square (lam_i / N), the
   decode taking the inverse, so a quantized KV cache sharing one scale per token keeps the weak dims.
3. The softmax scale D^-0.5 (or the source's own, Gemma 3's query_pre_attn_scalar^-0.5) -> (D + rope_dim)^-0.5 is
   folded into the query rows (exact). A query bias (Qwen2) rides
   through the q_lora path: q_a = W_q (+ bias), q_b = the per-head map of steps 1 and 3.
0. Per-head q/k norms before RoPE (Qwen3, OLMo 2) have no place in deepseek_v3: each is replaced by a constant,
   N(y) = g y / sqrt(mean(y^2) + eps) ~ (g / r) y with r = sqrt(E[mean(y^2)] + eps) over the calibration tokens,
   folded into the projection rows (qk_norm_multipliers). THE second approximation: what it costs is measured on its
   own (step qk_norm_fold) and printed.
4. deepseek_v3 always RMS-normalises the latent (and q_a's output). In memory those norms are identities (training
   works on the plain linear model); `fold_latent_norm` applies eps dominance at save: the latent rows are scaled by a
   power of two alpha so mean(c^2) << eps and RMSNorm(c) = c / sqrt(eps) to a relative error below 1e-7 for every
   possible input (a bound from the weights), then the norm weight and kv_b undo the scale.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field, fields, replace

import torch
from torch import nn
from tqdm.auto import tqdm

from headlab.core import cpu_attention
from headlab.core.arch import Adapter, HeadWeights, adapter_for
from headlab.core.checkpoint import check_checkpoint_out, logits_of, probe_inputs, save_with_record
from headlab.core.data import TextSpec, takes_text
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel, check_resident
from headlab.kv.gqa import measured_kv_bytes_per_token
from headlab.kv.grouping import gqa_layers
from headlab.kv.layer_rope import (
    SLIDING_ATTENTION,
    frequency_change,
    inverse_frequencies,
    layer_type_of,
    matched_frequencies,
    rope_parameters_for,
    window_of,
)
from headlab.kv.methods import mla_budget, mla_budget_numbers
from headlab.kv.post_norms import PreNormForm, constant_norms, norm_eps
from headlab.measure.costs import kv_bytes_per_token
from headlab.measure.evaluate import calibration_nll, perplexity
from headlab.mechanisms.capture import capture_attention
from headlab.mechanisms.hooks import hooks
from headlab.recovery.recover import RECOVERY_DIR, write_recovery

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, hard-coded for kv_a_layernorm and q_a_layernorm
# Relative error of RMSNorm(c) ~ c / sqrt(eps) allowed at the weights' worst-case input: m / (2 eps) <= FOLD_TOLERANCE.
FOLD_TOLERANCE = 1e-7
# Ridge added to the input Gram and the metric, relative to their mean eigenvalue: keeps every solve well posed on
# directions the calibration text never excites, and keeps the full-rank latent exact for any input.
RIDGE = 1e-8
# Rope dims tried for a budget below full rank: this many of rd, rd/2, rd/4, ... (the largest that leave a latent).
AUTO_ROPE_CANDIDATES = 3
# Key weights the measured split is also tried with (multiples of equal relative energy), lowest calibration NLL kept.
# Below full rank the latent serves keys and values together; equal relative energy over-weights keys: on the
# embedded model at the MQA budget 0.5 lowers calibration NLL 4.114 -> 4.085, 0.1 gives 4.109, 4 is far worse
# (docs/mla.md, "The latent's key weight").
KEY_WEIGHTS = (1.0, 0.5, 0.25)
# RoPE types whose kept frequencies and magnitude deepseek_v3's rotary embedding reproduces exactly (mla_rope_parameters).
MLA_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Largest relative difference allowed between the source's kept inverse frequencies and the converted model's: float32
# rounding (a yarn ramp at rope_dim < rd is recomputed from solved betas), far below any real frequency change.
FREQUENCY_TOLERANCE = 1e-6


# ---- the plan --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlaPlan:
    """The target layout: kv_lora_rank latent + rope_dim rotary numbers cached per token per layer."""

    num_heads: int  # H
    num_kv_heads: int  # G (source)
    head_dim: int  # D (= qk_nope_head_dim = v_head_dim)
    rotary_dim: int  # rd, the source's rotated dims per head
    kv_lora_rank: int
    rope_dim: int  # qk_rope_head_dim
    budget: str | None = None  # as given: "gqa", "mqa", a count ("48"), a fraction ("0.125"); None: explicit numbers
    rope_choice: str = "given"  # given, full (every frequency, latent at full rank) or measured (on calibration)
    q_bias: bool = False  # the source has a query bias: the q_lora path carries it
    q_lora_rank: int | None = None  # a low-rank query (q_a: C -> q_lora_rank, q_b: -> H (D + r)); None: full rank
    # The latent metric's key weight as a multiple of equal relative energy (step 2 of the module doc); 1 unless the
    # split was measured, when convert_to_mla also measures it among KEY_WEIGHTS
    key_weight: float = 1.0

    @property
    def full_rank(self) -> int:
        """Rank of [k_nope; v] after RoRoPE: 2GD numbers less the rope_dim moved into the shared rotary key."""
        return 2 * self.num_kv_heads * self.head_dim - self.rope_dim

    @property
    def cache_numbers(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def kept_frequencies(self) -> list[int]:
        """Source frequency indices (of rd/2) kept with RoPE: every n-th, n = rd / rope_dim."""
        step = self.rotary_dim // self.rope_dim
        return [j * step for j in range(self.rope_dim // 2)]

    @property
    def query_rank(self) -> int | None:
        """deepseek_v3's q_lora_rank: the low rank asked for, H x D to carry a query bias, else None (one q_proj)."""
        if self.q_lora_rank is not None:
            return self.q_lora_rank
        return self.num_heads * self.head_dim if self.q_bias else None

    def to_dict(self) -> dict:
        return {**asdict(self), "full_rank": self.full_rank, "cache_numbers": self.cache_numbers}


def inexpressible(loaded: LoadedModel) -> list[str]:
    """What of the source's attention configuration deepseek_v3 cannot express even approximately (soft-capping, MLP
    biases, bidirectional attention), in words; empty when nothing. Sliding windows and a second RoPE base are
    approximated and measured instead (the record's steps sliding_window and layer_rope)."""
    config = loaded.model.config.get_text_config()
    found = [what for what in ("attn_logit_softcapping", "final_logit_softcapping") if getattr(config, what, None)]
    if getattr(config, "mlp_bias", False):
        found.append("MLP biases")
    if getattr(config, "use_bidirectional_attention", False):
        found.append("bidirectional attention")
    return found


def check_source(loaded: LoadedModel, resident: bool = True) -> None:
    """Refuse (one line) an attention that deepseek_v3 cannot express, before any work. resident=False: the weights
    may wait offloaded (convert-mla --streaming reads them from the files, the model only runs calibration)."""
    if resident:
        check_resident(loaded, "MLA conversion")
    adapter, config = loaded.adapter, loaded.model.config.get_text_config()
    name = config.model_type
    if adapter.is_encoder or not adapter.rotary or adapter.gated:
        raise HeadlabError(f"{name}: MLA conversion needs a causal decoder with rotary attention and no output gate")
    gqa_layers(loaded)  # one (H, G) for every layer, else refused there
    unexpressed = inexpressible(loaded)
    if unexpressed:
        raise HeadlabError(f"{name} uses {' and '.join(unexpressed)}, which deepseek_v3 cannot express")
    if (adapter.post_norms or adapter.raw_sublayers) and not resident:
        raise HeadlabError(f"{name}'s post-norm blocks go to deepseek_v3 in their nearest pre-norm form, whose "
                           "constants need the model run whole: convert without --streaming")  # fmt: skip
    rope = rope_parameters_for(config)
    if rope.get("rope_type", "default") not in MLA_ROPE_TYPES:
        raise HeadlabError(
            f"{name} uses {rope.get('rope_type')} RoPE scaling; MLA conversion carries {', '.join(MLA_ROPE_TYPES)} only"
        )
    if any(p.dtype == torch.float16 for p in loaded.model.parameters()):
        raise HeadlabError(
            "float16 cannot hold the latent-norm fold (its tiny latents underflow); use dtype='float32' or 'bfloat16'"
        )


def plan_mla(
    loaded: LoadedModel,
    budget: str | int | float | None = None,
    *,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
    q_lora_rank: int | None = None,
    resident: bool = True,
) -> MlaPlan:
    """Validate and resolve the target: a budget (`mla_budget`: gqa = 2GD numbers per token per layer, the source's
    own cache; mqa = 2D; a count; a fraction of 2GD) or explicit numbers. rope_dim None under a budget: every rotary
    frequency when the latent then reaches full rank, otherwise left to `convert_to_mla` to measure on calibration
    windows (rope_choice "measured", among `auto_rope_dims`). q_lora_rank: a low-rank query path (`_low_rank_query`),
    below the hidden size so that it saves parameters. resident: as check_source's."""
    check_source(loaded, resident)
    layers = gqa_layers(loaded)
    H, G, D = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
    rd = loaded.adapter.rotary_dim(layers[0], loaded.model.config)
    q_bias = loaded.adapter.read(layers[0]).q_bias is not None
    if budget is not None and kv_lora_rank is not None:
        raise HeadlabError("give budget= or kv_lora_rank (with rope_dim), not both")
    if budget is None and kv_lora_rank is None:
        raise HeadlabError(
            "give a KV budget: budget='gqa', 'mqa', a count or a fraction; or kv_lora_rank (with rope_dim)"
        )
    if budget is not None:
        try:
            budget = mla_budget(budget)
        except ValueError as error:
            raise HeadlabError(str(error)) from None
        total = mla_budget_numbers(budget, G, D)
        if total > 2 * G * D:
            raise HeadlabError(
                f"budget {budget} is above the source's own cache of {2 * G * D} numbers per token per layer "
                f"(2 x {G} KV heads x {D}): a larger MLA cache would only cost memory"
            )
    else:
        total = kv_lora_rank + (rope_dim or rd)
    choice = "given"
    if rope_dim is None:
        rope_dim, choice = rd, "full"
        if budget is not None and total - rd < 2 * G * D - rd:
            choice = "measured"  # convert_to_mla picks among auto_rope_dims(...) on calibration windows
            candidates = auto_rope_dims(MlaPlan(H, G, D, rd, total - rd, rd))
            if not candidates:
                raise HeadlabError(
                    f"budget {budget} ({total} numbers per token per layer) leaves no room for a latent beside the "
                    f"smallest rope dim of the {rd} rotary dims"
                )
            rope_dim = candidates[0].rope_dim  # the plan holds a valid split; the search replaces it
    _check_rope_dim(rope_dim, rd)
    kv_lora_rank = total - rope_dim if kv_lora_rank is None else kv_lora_rank
    label = None if budget is None else str(budget)
    hidden = loaded.model.config.get_text_config().hidden_size
    if q_lora_rank is not None and not 1 <= q_lora_rank < min(hidden, H * D):
        raise HeadlabError(
            f"q_lora_rank={q_lora_rank} must be in [1, {min(hidden, H * D)}): at or above the hidden size {hidden} "
            f"(or the {H} x {D} query dims) a low-rank query saves nothing"
        )
    plan = MlaPlan(H, G, D, rd, kv_lora_rank, rope_dim, label, choice, q_bias, q_lora_rank)
    if kv_lora_rank < 1:
        raise HeadlabError(f"the budget of {total} numbers is not above rope_dim={rope_dim}: no room for a latent")
    if kv_lora_rank > plan.full_rank:
        raise HeadlabError(
            f"kv_lora_rank={kv_lora_rank} is above the full rank {plan.full_rank} of [K_nope; V] "
            f"(2 x {G} KV heads x {D} - {rope_dim} rope dims): a larger latent would only cost cache"
        )
    # The model class comes from transformers' lazy module: only a conversion builds one (start-up).
    from transformers import DeepseekV3ForCausalLM

    config = mla_config(loaded, plan)  # outside the meta device: it computes and checks the RoPE frequencies
    with torch.device("meta"):  # names and shapes only: the MLP and embeddings must map before any work
        _shared_weights(loaded, DeepseekV3ForCausalLM(config))
    return plan


def _check_rope_dim(rope_dim: int, rotary_dim: int) -> None:
    if rope_dim < 2 or rope_dim % 2 or rotary_dim % rope_dim:
        raise HeadlabError(
            f"rope_dim={rope_dim} must be an even divisor of the {rotary_dim} rotary dims (every n-th frequency is "
            "then exactly RoPE at that dim), e.g. " + ", ".join(str(rotary_dim // n) for n in (1, 2, 4, 8))
        )


def auto_rope_dims(plan: MlaPlan) -> list[MlaPlan]:
    """The candidate splits of plan's budget (cache_numbers): the AUTO_ROPE_CANDIDATES largest even divisors r of the
    rotary dims (rd, rd/2, rd/4, ...) that leave a latent of at least one number (latent = the rest, at most full
    rank). At the MQA budget of a 64-dim head: 64, 32, 16; at 48 numbers: 32, 16, 8."""
    total, out, n = plan.cache_numbers, [], 1
    while plan.rotary_dim // n >= 2 and len(out) < AUTO_ROPE_CANDIDATES:
        r = plan.rotary_dim // n
        if r % 2 == 0 and plan.rotary_dim % r == 0 and total - r >= 1:
            kv = min(total - r, 2 * plan.num_kv_heads * plan.head_dim - r)
            out.append(_replace(plan, rope_dim=r, kv_lora_rank=kv))
        n *= 2
    return out


def _replace(plan: MlaPlan, **changes) -> MlaPlan:
    return MlaPlan(**{**asdict(plan), **changes})


# ---- RoPE: the source's frequencies and magnitude in deepseek_v3's rotary embedding -------------------------------


def source_rope(loaded: LoadedModel, layer=None) -> tuple[torch.Tensor, float]:
    """The source's rotary inverse frequencies [rd/2] (float64) and attention factor (yarn's mscale; 1 otherwise):
    of `layer` (an attention layer), or of the full-attention layers, whose RoPE deepseek_v3 takes."""
    layers = gqa_layers(loaded)
    rd = loaded.adapter.rotary_dim(layers[0], loaded.model.config)
    config = loaded.model.config.get_text_config()
    return inverse_frequencies(config, rd, None if layer is None else layer_type_of(config, layer.block))


def layer_kept_frequencies(loaded: LoadedModel, plan: MlaPlan, layer) -> list[int | None]:
    """The source frequency indices `layer` keeps with RoPE: the plan's (every n-th) where the layer rotates at the
    full-attention layers' frequencies; else, per target pair, the source pair nearest in frequency
    (headlab.kv.layer_rope.matched_frequencies)."""
    own, shared = source_rope(loaded, layer)[0], source_rope(loaded)[0]
    if torch.equal(own, shared):
        return plan.kept_frequencies
    return matched_frequencies(own, shared[plan.kept_frequencies])


def query_scale_ratio(loaded: LoadedModel) -> float:
    """The source's softmax scale over D^-0.5 (attention modules' `scaling`: query_pre_attn_scalar^-0.5 in Gemma 3,
    D^-0.5 in most families), folded into the query rows with deepseek_v3's own (D + r)^-0.5 (exact)."""
    layer = gqa_layers(loaded)[0]
    ratio = float(getattr(layer.module, "scaling", layer.head_dim**-0.5)) * math.sqrt(layer.head_dim)
    return 1.0 if math.isclose(ratio, 1.0, rel_tol=1e-12) else ratio  # D^-0.5 sqrt(D) rounds off 1 at some D


def _yarn_range(params: dict, dim: int, base: float) -> tuple[float, float]:
    """YaRN's correction range in frequency indices at `dim` rotary dims (transformers' _compute_yarn_parameters,
    after Peng et al. 2023): corr(beta) = dim ln(L0 / (2 pi beta)) / (2 ln base) for beta_fast and beta_slow,
    floor/ceil when truncating, clamped to [0, dim - 1], nudged apart by 0.001 when equal (linear_ramp_factor)."""
    L0 = params["original_max_position_embeddings"]

    def corr(beta: float) -> float:
        return dim * math.log(L0 / (beta * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(params.get("beta_fast") or 32), corr(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    return low, (high + 0.001 if low == high else high)


def mla_rope_parameters(loaded: LoadedModel, plan: MlaPlan) -> dict:
    """deepseek_v3 rope_parameters whose rotary embedding, at dim rope_dim, has exactly the source's kept frequencies
    (every n-th of rd/2, n = rd / rope_dim). Default and llama3: the source's own parameters (both map each default
    frequency theta^(-2i/d) elementwise, and 2jn/rd = 2j/rope_dim). yarn: its ramp runs over frequency indices, so
    below rd it is re-anchored at the source's range / n (betas solved from corr(beta) = x, untruncated); mscale =
    mscale_all_dim = 1 is DeepSeek-V3's own form, which transformers and llama.cpp both read as cos/sin unscaled and
    the softmax scale times (1 + 0.1 ln factor)^2 (`rope_magnitudes` folds the rest into the query rows)."""
    source = loaded.model.config.get_text_config()
    rope = rope_parameters_for(source)
    rope_type, theta = rope.get("rope_type", "default"), float(rope["rope_theta"])
    if rope_type == "default":
        return {"rope_type": "default", "rope_theta": theta}
    if rope_type == "linear":  # every frequency divided by the factor: the same map at any dim
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(rope["factor"])}
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return {"rope_type": "llama3", "rope_theta": theta, **{k: rope[k] for k in keys}}
    L0 = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or source.max_position_embeddings / L0  # transformers' fallback for a missing factor
    params = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor), "original_max_position_embeddings": L0,
              "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    if plan.rope_dim == plan.rotary_dim:  # the same ramp: the source's own range, bit for bit
        return {**params, **{k: rope[k] for k in ("beta_fast", "beta_slow", "truncate") if rope.get(k) is not None}}
    n, r = plan.rotary_dim // plan.rope_dim, plan.rope_dim
    low, high = (x / n for x in _yarn_range(rope, plan.rotary_dim, theta))
    if high > r - 1:
        raise HeadlabError(
            f"yarn's correction range reaches frequency {high:g} of rope_dim={r}, beyond what deepseek_v3's ramp "
            f"holds at that dim; use rope_dim={plan.rotary_dim}"
        )

    def beta(x: float) -> float:  # corr(beta) = x at dim r
        return L0 / (2 * math.pi) * math.exp(-2 * x * math.log(theta) / r)

    return {**params, "beta_fast": beta(low), "beta_slow": beta(high), "truncate": False}


def rope_magnitudes(loaded: LoadedModel, config) -> tuple[float, float, float]:
    """Factors folded into the query rows so that every logit term keeps the source's scale: (nope rows of rotary
    origin, nope rows of non-rotary dims, rope rows) = (s a^2 / m, s / m, s a^2 / (m c^2)), with a the source's
    attention factor (q.k of its rotary dims scaled by a^2: cos and sin carry it), c the converted model's, m
    deepseek_v3's softmax-scale factor (yarn_apply_mscale, modeling_deepseek_v3: mscale(factor, mscale_all_dim)^2)
    and s the source's softmax scale over D^-0.5 (query_scale_ratio). All 1 for default, linear and llama3 RoPE under
    the usual D^-0.5 scale."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale  # start-up: lazy module

    a = source_rope(loaded)[1]
    c = inverse_frequencies(config, config.qk_rope_head_dim)[1]
    m = float(yarn_apply_mscale(config.rope_parameters, 1.0))
    s = query_scale_ratio(loaded)
    return s * a * a / m, s / m, s * a * a / (m * c * c)


def _check_frequencies(loaded: LoadedModel, plan: MlaPlan, config) -> float:
    """Max relative difference between the source's kept frequencies and the converted model's; refused above
    FREQUENCY_TOLERANCE (the conversion would not be the source's RoPE)."""
    kept = source_rope(loaded)[0][plan.kept_frequencies]
    target = inverse_frequencies(config, plan.rope_dim)[0]
    diff = float(((target - kept).abs() / kept.abs()).max())
    if diff > FREQUENCY_TOLERANCE:
        raise HeadlabError(
            f"deepseek_v3's {config.rope_parameters['rope_type']} RoPE at rope_dim={plan.rope_dim} misses the source's "
            f"kept frequencies by {diff:.2g} (relative); use rope_dim={plan.rotary_dim}"
        )
    return diff


# ---- calibration -------------------------------------------------------------------------------------------------


@torch.no_grad()
def input_grams(loaded: LoadedModel, batches, progress: bool = True) -> list[torch.Tensor]:
    """Per attention layer, Sigma = sum_t x_t x_t^T [C+1, C+1] (float64) of the attention input x (after the input
    norm) augmented by a constant 1 (biases), over the unpadded calibration tokens. Every Gram the conversion needs is
    W Sigma W^T of a projection W."""
    grams: dict[int, torch.Tensor] = {}

    def add(index: int, gram: torch.Tensor) -> None:
        grams[index] = grams[index] + gram if index in grams else gram

    layers = _gram_pass(loaded, batches, progress, add)
    if len(grams) != len(layers) or float(grams[layers[0].index][-1, -1]) == 0:
        raise HeadlabError("no calibration tokens to convert to MLA on")
    return [grams[layer.index] for layer in layers]


@torch.no_grad()  # statistics only: no graph (under a device map it would hold every block's weights)
def _gram_pass(loaded: LoadedModel, batches, progress: bool, add) -> list:
    """One forward pass over `batches` calling add(layer index, x^T x of this batch's augmented attention inputs)
    for every attention layer; returns the layers."""
    layers = gqa_layers(loaded)
    valid: list[torch.Tensor] = []

    def hook_for(layer):
        def hook(x):
            x = x[valid[0].to(x.device)].double()  # [N, C]
            x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype, device=x.device)], 1)  # [N, C+1]
            add(layer.index, (x.T @ x).cpu())

        return hook

    model, device = loaded.model, loaded.device
    with hooks(loaded.adapter, [("attn_in", layer, hook_for(layer)) for layer in layers]):
        for input_ids, attention_mask, *_ in tqdm(batches, desc="MLA calibration", disable=not progress):
            valid[:] = [attention_mask.bool()]
            model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    return layers


@torch.no_grad()
def rope_phases(loaded: LoadedModel, batches, progress: bool = True) -> list[torch.Tensor]:
    """Per attention layer, c[h, f] = sum_{t, s} A_h(t, s) e^{-i (t - s) theta_f} / sum A_h: the rotation a key at
    frequency f gets, relative to its query, averaged over head h's attention on the calibration windows ([H, F]
    complex128). A key part that loses RoPE is best replaced, in mean square over that distribution, by itself times
    c (E|a e^{i phi} - b|^2 is least at b = a E[e^{i phi}]); the conversion folds conj(c) into the nope queries."""
    layers = gqa_layers(loaded)
    H = layers[0].num_heads
    hist: dict[int, torch.Tensor] = {}

    def on_chunk(chunk) -> None:
        probs = chunk.probs.double() * chunk.query_valid[:, None, :, None]  # [B, H, c, Tk]
        c, Tk = probs.shape[2:]
        distance = chunk.rows[:, None].cpu() - torch.arange(Tk)[None, :]  # [c, Tk], t - s
        index = distance.clamp_min(0).reshape(-1).expand(H, -1)
        counts = torch.zeros(H, Tk, dtype=torch.float64)  # distances < Tk: as long as the window, not the model
        counts.scatter_add_(1, index, probs.sum(0).reshape(H, c * Tk).cpu())
        i = chunk.layer.index
        if i in hist:  # windows of different lengths: the shorter histogram is padded with zeros
            longest = max(hist[i].shape[1], Tk)
            hist[i] = _padded(hist[i], longest) + _padded(counts, longest)
        else:
            hist[i] = counts

    model, device = loaded.model, loaded.device
    with capture_attention(model, layers, on_chunk):
        for input_ids, attention_mask, *_ in tqdm(batches, desc="MLA RoPE phases", disable=not progress):
            model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    phases = []
    for layer in layers:
        inv_freq = source_rope(loaded, layer)[0]  # [F], the layer's own (scaled) frequencies
        counts = hist[layer.index]  # [H, T] attention mass at each distance
        angles = torch.arange(counts.shape[1], dtype=torch.float64)[:, None] * inv_freq[None, :]  # [T, F]
        mean = torch.complex(counts @ angles.cos(), -(counts @ angles.sin()))
        phases.append(mean / counts.sum(1, keepdim=True).clamp_min(1e-300))
    return phases


def _padded(counts: torch.Tensor, length: int) -> torch.Tensor:
    return torch.nn.functional.pad(counts, (0, length - counts.shape[1]))


# ---- the algebra of one layer --------------------------------------------------------------------------------------


def _ridged(S: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    S = (S + S.T) / 2
    scale = float(S.diagonal().mean().clamp_min(1e-300))
    return S + ridge * scale * torch.eye(S.shape[0], dtype=S.dtype)


def _sym_power(S: torch.Tensor, power: float) -> torch.Tensor:
    lam, Q = torch.linalg.eigh(S)
    return (Q * lam.clamp_min(lam.max() * 1e-15) ** power) @ Q.T


@dataclass
class LayerMla:
    """One converted layer (float64): the query map per head, the rotary key rows, the latent and its decoder."""

    query_map: torch.Tensor  # [H, D + r, D]   q_mla_h = query_map[h] @ q_h (scale, RoRoPE factors, layout)
    rope_rows: torch.Tensor  # [r, C+1]        shared rotary key (interleaved pairs), last column the bias
    latent_rows: torch.Tensor  # [R, C+1]      latent c = latent_rows @ [x; 1]
    decode: torch.Tensor  # [H, 2D, R]         per head [k_nope_h; v_h] = decode[h] @ c
    balance: float = 1.0
    record: dict = field(default_factory=dict)
    query_low_rank: tuple[torch.Tensor, torch.Tensor] | None = None  # (q_a [Rq, C+1], q_b [H (D + r), Rq])


def _rorope(k_aug: torch.Tensor, Sk: torch.Tensor, query_energy: torch.Tensor, plan: MlaPlan, kept: list | None = None):
    """Per kept frequency: the shared rotary key's complex coefficients and each group's factor a_g (z_g ~ a_g w).

    k_aug [G, D, C+1]; Sk [G*D, G*D] key Gram; query_energy [G, F] = sum_{h in g} E|q_{h,f}|^2; kept: the source
    frequency index each rotary pair carries (default: plan.kept_frequencies; layer_kept_frequencies).
    Returns (rope_rows [r, C+1] interleaved, factors [F_kept, G] complex, nope_keys [G, D, C+1])."""
    G, D, _ = k_aug.shape
    F = plan.rotary_dim // 2
    nope = k_aug.clone()
    rope_rows, factors = [], []
    for f in plan.kept_frequencies if kept is None else kept:
        if f is None:  # a rotary pair that carries none of this layer's (layer_kept_frequencies): zero
            rope_rows += [k_aug.new_zeros(k_aug.shape[2])] * 2
            factors.append(torch.zeros(G, dtype=torch.complex128))
            continue
        re, im = [g * D + f for g in range(G)], [g * D + f + F for g in range(G)]
        # Hermitian Gram E[z z^H] of z_g = x_g + i y_g from the real key Gram.
        xx, yy, xy, yx = Sk[re][:, re], Sk[im][:, im], Sk[re][:, im], Sk[im][:, re]
        gram = torch.complex(xx + yy, yx - xy)  # [G, G]
        s = query_energy[:, f].clamp_min(1e-300).sqrt()  # weight each group by its queries' energy at f
        weighted = s[:, None] * gram * s[None, :]
        _, vecs = torch.linalg.eigh((weighted + weighted.conj().T) / 2)
        u = vecs[:, -1]  # top component
        coef = u.conj() * s  # w = sum_g coef_g z_g
        a = u / s  # z_g ~ a_g w
        z = torch.complex(k_aug[:, f], k_aug[:, f + F])  # [G, C+1] complex coefficient rows
        w = (coef[:, None] * z).sum(0)  # [C+1]
        resid = z - a[:, None] * w[None, :]
        nope[:, f], nope[:, f + F] = resid.real, resid.imag
        rope_rows += [w.real, w.imag]  # interleaved: (2j, 2j + 1) = (re, im)
        factors.append(a)
    return torch.stack(rope_rows), torch.stack(factors), nope


def _query_map(
    factors: torch.Tensor,
    plan: MlaPlan,
    phases: torch.Tensor | None = None,
    magnitude: tuple[float, float, float] = (1.0, 1.0, 1.0),
    kept: list[int] | None = None,
) -> torch.Tensor:
    """[H, D + r, D]: q_nope = s q_h, q_rope pair j = s conj(a_{g(h)}) (q_{h,f} + i q_{h,f+F}) with
    s = sqrt((D + r) / D), which turns deepseek's softmax scale (D + r)^-0.5 back into the source's D^-0.5.
    phases [H, F] (rope_phases): the nope query of rotary pair f becomes s conj(c_{h,f}) q_{h,f}, the key parts that
    lose RoPE then count with their mean rotation. magnitude (rope_magnitudes): the RoPE magnitude folded into the
    nope rows of rotary origin, the non-rotary nope rows and the rope rows."""
    H, G, D, r = plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.rope_dim
    F = plan.rotary_dim // 2
    s = math.sqrt((D + r) / D)
    maps = torch.zeros(H, D + r, D, dtype=torch.float64)
    maps[:, :D, :D] = s * torch.eye(D, dtype=torch.float64)
    if phases is not None:
        cr, ci = phases.real, phases.imag  # conj(c) (x + i y) = (cr x + ci y) + i (cr y - ci x)
        f = torch.arange(F)
        maps[:, f, f], maps[:, f, f + F] = s * cr, s * ci
        maps[:, f + F, f], maps[:, f + F, f + F] = -s * ci, s * cr
    for j, f in enumerate(plan.kept_frequencies if kept is None else kept):
        if f is None:  # this layer's queries leave the pair at zero
            continue
        for h in range(H):
            a = factors[j, h // (H // G)]
            ar, ai = float(a.real), float(a.imag)
            # conj(a) (x + i y) = (ar x + ai y) + i (ar y - ai x)
            maps[h, D + 2 * j, f], maps[h, D + 2 * j, f + F] = s * ar, s * ai
            maps[h, D + 2 * j + 1, f], maps[h, D + 2 * j + 1, f + F] = -s * ai, s * ar
    rotary, plain, rope = magnitude
    maps[:, : 2 * F] *= rotary
    maps[:, 2 * F : D] *= plain
    maps[:, D:] *= rope
    return maps


def convert_layer(
    w,
    sigma: torch.Tensor,
    plan: MlaPlan,
    balance: float | None = None,
    phases: torch.Tensor | None = None,
    magnitude: tuple[float, float, float] = (1.0, 1.0, 1.0),
    kept: list[int] | None = None,
) -> LayerMla:
    """One layer's MLA weights from its HeadWeights `w` and input Gram `sigma` [C+1, C+1] (see the module doc);
    magnitude: rope_magnitudes, folded into the query map; kept: the source frequency each rotary pair carries
    (default: the plan's)."""
    kept = plan.kept_frequencies if kept is None else kept
    H, G, D, R = plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.kv_lora_rank
    C = w.q.shape[2]
    sigma = _ridged(sigma.double())

    def aug(weight, bias, shape):
        b = torch.zeros(*shape, 1, dtype=torch.float64) if bias is None else bias.double().reshape(*shape, 1)
        return torch.cat([weight.double(), b], -1)

    q_aug, k_aug, v_aug = aug(w.q, w.q_bias, (H, D)), aug(w.k, w.k_bias, (G, D)), aug(w.v, w.v_bias, (G, D))
    Sq = torch.einsum("hdc,ce,hfe->hdf", q_aug, sigma, q_aug)  # [H, D, D] per-head query Grams
    Sk = k_aug.reshape(G * D, C + 1) @ sigma @ k_aug.reshape(G * D, C + 1).T
    F = plan.rotary_dim // 2
    diag = Sq.diagonal(dim1=1, dim2=2)  # [H, D]
    energy = (diag[:, :F] + diag[:, F : 2 * F]).reshape(G, H // G, F).sum(1)  # [G, F]
    rope_rows, factors, nope = _rorope(k_aug, Sk, energy, plan, kept)
    query_map = _query_map(factors, plan, phases, magnitude, kept)

    # Metric: keys by their queries' Gram (with the new scale the logits are unchanged), values by the output map.
    o = w.o.double()  # [C, H, D]
    key_metric = Sq.reshape(G, H // G, D, D).sum(1)  # [G, D, D]
    value_metric = torch.einsum("chd,che->hde", o, o).reshape(G, H // G, D, D).sum(1)  # [G, D, D]
    A = torch.cat([nope.reshape(G * D, C + 1), v_aug.reshape(G * D, C + 1)])  # [2GD, C+1]
    SA = A @ sigma @ A.T
    if balance is None:  # equal relative energy: key and value errors count as fractions of their own totals
        e_k = sum(float((key_metric[g] * SA[g * D : (g + 1) * D, g * D : (g + 1) * D]).sum()) for g in range(G))
        off = G * D
        e_v = sum(
            float((value_metric[g] * SA[off + g * D : off + (g + 1) * D, off + g * D : off + (g + 1) * D]).sum())
            for g in range(G)
        )
        # A side with (numerically) nothing to keep, as the residual keys of an MQA source, leaves the metric as is.
        balance = plan.key_weight * e_v / e_k if min(e_k, e_v) > 1e-12 * max(e_k, e_v) else 1.0
    blocks = [_ridged(b) for b in (*(balance * key_metric), *value_metric)]  # B = blockdiag(blocks), per block
    encode, decode_all, lam, energy_kept = _reduced_rank(A, SA, blocks, R)  # [R, C+1], [2GD, R]
    # Latent dim i has calibration mean square lam_i / N, and the eigenvalues fall by orders of magnitude: a quantized
    # KV cache that shares a scale across a token's latent dims (int4 groups) would round the weak dims away. Each
    # dim is scaled to unit mean square (the decode takes the inverse), exact in full precision; a floor at 1e-6 of
    # the strongest keeps unexcited dims from being blown up.
    energy = lam[:R].clamp_min(float(lam.max()) * 1e-6).clamp_min(1e-300) / max(float(sigma[-1, -1]), 1.0)
    unit = energy.rsqrt()  # [R]
    latent_rows = unit[:, None] * encode  # [R, C+1]
    decode_groups = (decode_all / unit[None, :]).reshape(2, G, D, R)  # [k|v, G, D, R]
    decode = torch.cat([decode_groups[0], decode_groups[1]], 1).repeat_interleave(H // G, 0)  # [H, 2D, R]
    record = {"balance": balance, "latent_energy_kept": energy_kept}
    layer = LayerMla(query_map, rope_rows, latent_rows, decode, balance, record)
    if plan.q_lora_rank is not None:
        layer.query_low_rank, record["query_energy_kept"] = _low_rank_query(q_aug, layer, sigma, plan)
    return layer


def _low_rank_query(q_aug: torch.Tensor, layer: LayerMla, sigma: torch.Tensor, plan: MlaPlan):
    """The converted query Q = blockdiag(query_map) q_aug [H (D + r), C+1] at rank Rq = plan.q_lora_rank: reduced-rank
    regression under the key metric, so what is kept is what moves the logits q.k. Per head the metric is its
    converted key's Gram E[k k^T] (nope block k_nope_h = decode_k[h] c), with the rotary pairs averaged over their
    relative rotation: each pair's 2 x 2 block -> (trace / 2) I and no cross terms, the expectation of R k k^T R^T
    over uniform angles. q_a = U^T B^{1/2} Q, q_b = B^{-1/2} U, U = top eigenvectors of B^{1/2} Q Sigma Q^T B^{1/2}
    (as the latent, step 2). Returns ((q_a, q_b), fraction of the metric-weighted query energy kept)."""
    H, D, r, Rq = plan.num_heads, plan.head_dim, plan.rope_dim, plan.q_lora_rank
    Q = torch.einsum("hed,hdc->hec", layer.query_map, q_aug).reshape(H * (D + r), -1)
    rope_gram = layer.rope_rows @ sigma @ layer.rope_rows.T  # [r, r], interleaved pairs (2j, 2j + 1)
    pair = (rope_gram.diagonal()[0::2] + rope_gram.diagonal()[1::2]) / 2
    rope_metric = torch.diag(pair.repeat_interleave(2))
    blocks = []
    for h in range(H):
        nope = layer.decode[h, :D] @ layer.latent_rows  # [D, C+1]
        blocks.append(_ridged(torch.block_diag(nope @ sigma @ nope.T, rope_metric)))
    down, up, _, kept = _reduced_rank(Q, Q @ sigma @ Q.T, blocks, Rq)
    return (down, up), kept


def _reduced_rank(A: torch.Tensor, gram: torch.Tensor, blocks: list[torch.Tensor], rank: int):
    """Reduced-rank regression of the linear map A [m, C+1] onto `rank` dims under the metric B = blockdiag(blocks),
    given gram = A Sigma A^T (Sigma the input Gram): encode = U^T B^{1/2} A, decode = B^{-1/2} U with U the top
    eigenvectors of B^{1/2} gram B^{1/2}, the minimiser of E ||B^{1/2} (A - decode encode) x||^2 (Eckart-Young).
    Returns (encode [rank, C+1], decode [m, rank], eigenvalues in descending order, fraction of the energy kept)."""
    root = torch.block_diag(*(_sym_power(b, 0.5) for b in blocks))
    inv_root = torch.block_diag(*(_sym_power(b, -0.5) for b in blocks))
    M = root @ gram @ root
    lam, U = torch.linalg.eigh((M + M.T) / 2)
    lam, U = lam.flip(-1), U.flip(-1)[:, :rank]
    kept = float(lam[:rank].clamp_min(0).sum() / lam.clamp_min(0).sum().clamp_min(1e-300))
    return U.T @ root @ A, inv_root @ U, lam, kept


# ---- building the deepseek_v3 model ------------------------------------------------------------------------------


def mla_config(loaded: LoadedModel, plan: MlaPlan):
    """The vanilla deepseek_v3 config of the converted model: dense SwiGLU MLP in every layer (first_k_dense_replace =
    layer count), q_lora for a low-rank query or to carry a query bias, as many KV heads as query heads, consecutive-pair RoPE at
    rope_dim with the source's kept frequencies (mla_rope_parameters; checked, refused if they differ). rms_norm_eps
    is the latent norm's 1e-6, since vLLM and llama.cpp read the latent norm's eps from it (the decoder norms' change
    is measured in the record)."""
    # The deepseek_v3 config class is imported with transformers' lazy module: only a conversion needs it (start-up).
    from transformers import DeepseekV3Config

    source = loaded.model.config.get_text_config()
    L = source.num_hidden_layers
    bias = any(t is not None for t in _biases(loaded.adapter.read(loaded.layers[0])))
    ids = {k: getattr(source, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = DeepseekV3Config(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        moe_intermediate_size=source.intermediate_size,
        num_hidden_layers=L,
        num_attention_heads=plan.num_heads,
        num_key_value_heads=plan.num_heads,
        n_shared_experts=1,
        n_routed_experts=1,  # an int: the strict config rejects None; no layer is MoE (first_k_dense_replace = L)
        n_group=1,
        topk_group=1,
        num_experts_per_tok=1,
        first_k_dense_replace=L,
        kv_lora_rank=plan.kv_lora_rank,
        q_lora_rank=plan.query_rank,
        qk_rope_head_dim=plan.rope_dim,
        qk_nope_head_dim=plan.head_dim,
        v_head_dim=plan.head_dim,
        hidden_act=getattr(source, "hidden_activation", None) or source.hidden_act,  # Gemma names it apart
        max_position_embeddings=source.max_position_embeddings,
        initializer_range=getattr(source, "initializer_range", 0.02),
        rms_norm_eps=LATENT_NORM_EPS,
        # A scaled embedding is folded into its rows, so the unembedding can no longer share them.
        tie_word_embeddings=bool(getattr(source, "tie_word_embeddings", False)) and embedding_scale(loaded) == 1.0,
        rope_parameters=mla_rope_parameters(loaded, plan),
        rope_interleave=True,
        attention_bias=bias,
        attention_dropout=0.0,
        num_mtp_layers=0,
        **ids,
    )
    _check_frequencies(loaded, plan, config)
    return config


def _biases(w):
    return (w.q_bias, w.k_bias, w.v_bias, w.o_bias)


def embedding_scale(loaded: LoadedModel) -> float:
    """The factor the input embedding multiplies its rows by (Gemma's sqrt(C): an `embed_scale` on the module), 1.0
    where it has none. deepseek_v3 has none: the conversion folds it into the rows, untying the unembedding."""
    scale = getattr(loaded.model.get_input_embeddings(), "embed_scale", None)
    return 1.0 if scale is None else float(scale)


def _shared_weights(loaded: LoadedModel, target: nn.Module, pre_norm: PreNormForm | None = None) -> dict:
    """The source's non-attention tensors (embeddings, norms, MLPs, lm_head) under the target's names, which
    llama-style families share, in deepseek_v3's pre-norm block form (_pre_norm_tensors). Any tensor missing,
    misshapen or left over is refused: the MLP is not deepseek's."""
    source = {k: v for k, v in loaded.model.state_dict().items() if ".self_attn." not in k}
    source = _pre_norm_tensors(loaded, source, pre_norm)
    wanted = {k: v for k, v in target.state_dict().items() if ".self_attn." not in k}
    if "lm_head.weight" in wanted and "lm_head.weight" not in source:  # a tied unembedding the target unties
        source["lm_head.weight"] = loaded.model.get_output_embeddings().weight.detach()
    missing = [k for k, v in wanted.items() if k not in source or source[k].shape != v.shape]
    extra = [k for k in source if k not in wanted]
    if missing or extra:
        raise HeadlabError(
            f"{loaded.model.config.model_type}'s non-attention weights do not map onto deepseek_v3 (dense SwiGLU MLP): "
            f"missing or misshapen {missing[:3]}, left over {extra[:3]}"
        )
    return {k: source[k] for k in wanted}


def _pre_norm_tensors(loaded: LoadedModel, source: dict, pre_norm: PreNormForm | None) -> dict:
    """`source` (non-attention tensors) in deepseek_v3's block form, every step exact but the post-norm constants:
    each block's pre-norms (adapter.pre_norms) become input_layernorm and post_attention_layernorm, and every norm
    weight takes the adapter's norm offset (Gemma's 1 + w); a post-norm source's post-norms are taken out, the
    MLP-output constant of its pre-norm form folded into down_proj's rows, and a block reading the raw residual stream
    gets norms filled with the form's gains (headlab.kv.post_norms); the embedding's scale is folded into its rows
    (embedding_scale; the unembedding keeps the source's rows). Without a form (the plan's check on the meta device)
    gains and constants are ones: the names and shapes are what it checks."""
    adapter = loaded.adapter
    blocks = adapter.blocks(loaded.model)
    prefix = next(name for name, module in loaded.model.named_modules() if module is blocks)
    offset = adapter.norm_offset
    source = dict(source)
    for i in range(len(blocks)):
        at = f"{prefix}.{i}."
        posts = [source.pop(at + name + ".weight") for name in adapter.post_norms]
        if adapter.raw_sublayers:  # no pre-norms of its own: the form's, at its calibration gains
            gains = pre_norm.gains[i] if pre_norm is not None and pre_norm.gains else (1.0, 1.0)
            norms = [posts[0].new_full(posts[0].shape, gain) for gain in gains]
        else:
            norms = [source.pop(at + name + ".weight") + offset for name in adapter.pre_norms]
        for name, weight in zip(("input_layernorm", "post_attention_layernorm"), norms):
            source[at + name + ".weight"] = weight
        down = at + "mlp.down_proj.weight"
        if pre_norm is not None and adapter.post_norms and down in source:
            source[down] = (source[down].double() * pre_norm.outputs[i][1][:, None].to(source[down].device)).to(
                source[down].dtype
            )
    final = prefix.rsplit(".", 1)[0] + "." + adapter.final_norm_name + ".weight"
    if offset and final in source:
        source[final] = source[final] + offset
    scale = embedding_scale(loaded)
    if scale != 1.0:
        embed = loaded.model.get_input_embeddings()
        name = next(n for n, m in loaded.model.named_modules() if m is embed) + ".weight"
        source[name] = source[name] * embed.embed_scale.to(source[name].dtype)  # the product its forward takes
    return source


def _write_attention(attn: nn.Module, w, layer: LayerMla, plan: MlaPlan) -> None:
    """Put one converted layer into a DeepseekV3Attention module; its latent (and q_a) norms become identities."""
    H, D, r = plan.num_heads, plan.head_dim, plan.rope_dim
    C = w.q.shape[2]
    dtype = attn.kv_b_proj.weight.dtype

    def put(linear, weight, bias=None):
        linear.weight.data.copy_(weight.to(dtype))
        if linear.bias is not None:
            linear.bias.data.copy_(torch.zeros(weight.shape[0]) if bias is None else bias.to(dtype))

    q = w.q.double()  # [H, D, C]
    if attn.q_proj is not None:
        put(attn.q_proj, torch.einsum("hed,hdc->hec", layer.query_map, q).reshape(H * (D + r), C))
    elif layer.query_low_rank is not None:  # a low-rank query: the bias (if any) rides in q_a's
        down, up = layer.query_low_rank
        put(attn.q_a_proj, down[:, :C], down[:, C])
        put(attn.q_b_proj, up)
        attn.q_a_layernorm = nn.Identity()
    else:
        put(attn.q_a_proj, q.reshape(H * D, C), w.q_bias.double().reshape(H * D))
        put(attn.q_b_proj, torch.block_diag(*layer.query_map))
        attn.q_a_layernorm = nn.Identity()
    rows = torch.cat([layer.latent_rows, layer.rope_rows])  # [R + r, C+1]
    put(attn.kv_a_proj_with_mqa, rows[:, :C], rows[:, C])
    attn.kv_a_layernorm = nn.Identity()
    put(attn.kv_b_proj, layer.decode.reshape(H * 2 * D, plan.kv_lora_rank))
    put(attn.o_proj, w.o.double().reshape(C, H * D), None if w.o_bias is None else w.o_bias.double())


@torch.no_grad()
# ---- per-head q/k norms: a calibrated constant ----------------------------------------------------------------


def qk_norm_multipliers(loaded: LoadedModel, layer, weights: HeadWeights, gram: torch.Tensor):
    """(query, key) multipliers [H, D] / [G, D] (None where the layer has no such norm) that stand in for a per-head
    RMS norm before RoPE: N(y) = g y / sqrt(mean(y^2) + eps) ~ (g / r) y, r = sqrt(E[mean(y^2)] + eps), the mean over
    one head's D values (Qwen3) or over all heads (OLMo 2, a norm spanning heads), E over the calibration tokens from
    the input Gram (E[y y^T] = W_aug Sigma W_aug^T / N, y = W x + b). g counts the adapter's norm offset."""
    modules = loaded.adapter.qk_norm_modules(layer)
    tokens = float(gram[-1, -1])
    out = []
    for proj, bias, stored, module in ((weights.q, weights.q_bias, weights.q_norm, modules[0]),
                                       (weights.k, weights.k_bias, weights.k_norm, modules[1])):  # fmt: skip
        if stored is None:
            out.append(None)
            continue
        heads, D, _ = proj.shape
        column = bias.double() if bias is not None else torch.zeros(heads, D, dtype=torch.float64)
        W = torch.cat([proj.double().cpu(), column.cpu()[..., None]], dim=-1)  # [h, D, C+1]
        second = torch.einsum("hdc,ce,hde->hd", W, gram.double(), W) / tokens  # E[y_hd^2]
        spans = stored.dim() == 2
        r = (second.mean() if spans else second.mean(-1, keepdim=True)) + norm_eps(module)  # [] or [h, 1]
        gain = stored.double().cpu() + loaded.adapter.norm_offset  # [D] or [h, D]
        out.append((gain / r.sqrt()).expand(heads, D).clone())
    return tuple(out)


def fold_qk_norm(weights: HeadWeights, multipliers) -> HeadWeights:
    """The layer's weights with its q/k norms replaced by their constant multipliers, folded into the projection rows
    and biases (the norm acts before RoPE, so scaling the rows is the same map)."""
    mq, mk = (None if m is None else m.to(weights.q.dtype) for m in multipliers)
    changes = {"q_norm": None, "k_norm": None}
    for name, m in (("q", mq), ("k", mk)):
        if m is None:
            continue
        changes[name] = getattr(weights, name) * m.to(getattr(weights, name).device)[..., None]
        bias = getattr(weights, f"{name}_bias")
        changes[f"{name}_bias"] = None if bias is None else bias * m.to(bias.device)
    return replace(weights, **changes)


def all_qk_norm_multipliers(loaded: LoadedModel, grams: list[torch.Tensor]) -> list | None:
    """qk_norm_multipliers of every attention layer, or None when no layer normalises its query/key heads."""
    layers = gqa_layers(loaded)
    if all(m is None for layer in layers for m in loaded.adapter.qk_norm_modules(layer)):
        return None
    return [qk_norm_multipliers(loaded, layer, loaded.adapter.read(layer), grams[layer.index]) for layer in layers]


def constant_qk_norms(loaded: LoadedModel, multipliers: list):
    """Run the source with each q/k norm replaced by its constant (the fold alone, in the source's own modules):
    the norm's forward becomes y * m, m shaped like its input's last dims ([h, D], [h, 1, D] where heads come before
    positions, or [h * D] for a spanning norm)."""
    first = loaded.adapter.qk_norm_heads_first
    pairs = [
        (module, m.reshape(-1) if module.weight.numel() == m.numel() else m[:, None] if first else m)
        for layer, pair in zip(gqa_layers(loaded), multipliers)
        for module, m in zip(loaded.adapter.qk_norm_modules(layer), pair)
        if module is not None and m is not None
    ]
    return constant_norms(pairs)


def _on_cpu(w: HeadWeights) -> HeadWeights:
    """The layer's weights on the CPU, beside its Gram (calibration accumulates the Grams there): the conversion's
    float64 algebra runs there whatever device the model is on."""
    return replace(w, **{f.name: getattr(w, f.name).cpu() for f in fields(w) if torch.is_tensor(getattr(w, f.name))})


def convert_into(w, gram, plan: MlaPlan, attn: nn.Module, *, phase=None, magnitude=(1.0, 1.0, 1.0), multipliers=None,
                 out_scale=None, kept=None):  # fmt: skip
    """Convert one layer's HeadWeights `w` (its input Gram, rope phases and q/k-norm multipliers, if any) into the
    DeepseekV3Attention module `attn` (latent norms off); out_scale [C]: a post-norm's constant, folded into o's
    rows; kept: layer_kept_frequencies (default: the plan's). Returns the layer's record."""
    w = _on_cpu(w)
    if multipliers is not None:  # per-head q/k norms: their calibrated constant, folded into the rows
        w = fold_qk_norm(w, multipliers)
    if out_scale is not None:  # a post-attention norm's constant (headlab.kv.post_norms)
        bias = None if w.o_bias is None else w.o_bias * out_scale.to(w.o_bias)
        w = replace(w, o=w.o * out_scale.to(w.o)[:, None, None], o_bias=bias)
    converted = convert_layer(w, gram, plan, phases=phase, magnitude=magnitude, kept=kept)
    _write_attention(attn, w, converted, plan)
    return converted.record


def build_mla(
    loaded: LoadedModel,
    plan: MlaPlan,
    grams: list[torch.Tensor],
    phases=None,
    progress: bool = False,
    qk_multipliers: list | None = None,
    pre_norm: PreNormForm | None = None,
) -> LoadedModel:
    """The converted model in memory (latent norms off), as a LoadedModel beside the untouched source. phases: per
    layer rope_phases (None: the key parts that lose RoPE count as they are); qk_multipliers: all_qk_norm_multipliers
    when the caller has them (None: computed from `grams`, a no-op for sources without q/k norms); pre_norm: a
    post-norm source's nearest pre-norm form (headlab.kv.post_norms; `grams` and `phases` gathered in it)."""
    # The model class comes from transformers' lazy module: only a conversion builds one (start-up).
    from transformers import DeepseekV3ForCausalLM

    config = mla_config(loaded, plan)
    config._attn_implementation = getattr(loaded.model.config, "_attn_implementation", None) or "sdpa"
    model = DeepseekV3ForCausalLM(config).to(loaded.dtype).eval()
    model.load_state_dict(_shared_weights(loaded, model, pre_norm), strict=False)
    records = []
    layers = gqa_layers(loaded)
    magnitude = rope_magnitudes(loaded, config)
    multipliers = qk_multipliers if qk_multipliers is not None else all_qk_norm_multipliers(loaded, grams)
    shared = source_rope(loaded)[0][plan.kept_frequencies]  # the frequencies deepseek_v3's rotary pairs turn at
    changes = {}
    for layer in tqdm(layers, desc="MLA layers", disable=not progress, unit="layer"):
        phase = None if phases is None else phases[layer.index]
        multiplier = None if multipliers is None else multipliers[layer.index]
        attn = model.model.layers[layer.block].self_attn
        out_scale = None if pre_norm is None else pre_norm.outputs[layer.block][0]
        kept = layer_kept_frequencies(loaded, plan, layer)
        records.append(convert_into(loaded.adapter.read(layer), grams[layer.index], plan, attn, phase=phase,
                                    magnitude=magnitude, multipliers=multiplier, out_scale=out_scale,
                                    kept=kept))  # fmt: skip
        if kept != plan.kept_frequencies:  # a layer with RoPE of its own (Gemma 3's sliding layers)
            changes[layer.block] = frequency_change(source_rope(loaded, layer)[0], shared, kept)
    model.tie_weights()
    model.to(loaded.device)
    try:
        adapter = adapter_for(model)  # a deepseek_v3 adapter where one is registered (headlab.core.arch)
    except HeadlabError:
        adapter = Adapter(("deepseek_v3",))  # enough for perplexity and saving
    source_type = rope_parameters_for(loaded.model.config.get_text_config()).get("rope_type", "default")
    rope = {"source_type": source_type, "parameters": dict(config.rope_parameters), "magnitude": list(magnitude),
            "frequencies_max_rel_diff": _check_frequencies(loaded, plan, config)}  # fmt: skip
    meta = {"mla_layers": records, "rope": rope, "rope_frequency_change": changes}
    meta.update(cpu_attention.install(model, loaded.device, config.qk_head_dim > config.v_head_dim))
    return LoadedModel(model, loaded.tokenizer, adapter, loaded.spec, loaded.source, loaded.device, loaded.dtype, meta)


# ---- the latent-norm fold ---------------------------------------------------------------------------------------


def _fold_one(proj: nn.Linear, rows: int, gamma: torch.Tensor, reader: nn.Linear, eps: float) -> dict:
    """Scale proj's first `rows` outputs c by a power of two alpha with mean(c^2) <= 2 FOLD_TOLERANCE eps for every
    input (bound: |c| <= ||W diag(gamma)||_2 sqrt(C) + |b|, as the input norm keeps |x / gamma| <= sqrt(C)), so
    RMSNorm(c) = c / sqrt(eps + mean c^2) = c / sqrt(eps) (1 - m / 2eps); the norm weight 2^b and reader's columns
    undo the scale: sqrt(eps) / (alpha 2^b)."""
    W = proj.weight.detach().double()[:rows]  # [rows, C]
    b = proj.bias.detach().double()[:rows] if proj.bias is not None else W.new_zeros(rows)
    C = W.shape[1]
    bound = float(torch.linalg.matrix_norm(W * gamma.detach().double()[None, :], ord=2)) * math.sqrt(C)
    bound = (bound + float(b.norm())) ** 2 / rows  # max mean(c^2)
    alpha = 1.0 if bound == 0 else 2.0 ** math.floor(0.5 * math.log2(2 * FOLD_TOLERANCE * eps / bound))
    power = 2.0 ** round(math.log2(math.sqrt(eps) / alpha))
    proj.weight.data[:rows] *= alpha  # a power of two: exact in every float format
    if proj.bias is not None:
        proj.bias.data[:rows] *= alpha
    reader.weight.data.copy_((reader.weight.detach().double() * (math.sqrt(eps) / (alpha * power))).to(reader.weight))
    return {"alpha": alpha, "norm_weight": power, "bound_mean_square": bound}


@torch.no_grad()
def fold_latent_norm(model: nn.Module, eps: float = LATENT_NORM_EPS) -> list[dict]:
    """Replace each identity latent norm (and q_a norm) of a converted deepseek_v3 model by transformers' RMSNorm
    with the eps-dominance fold, in place; layers already holding a norm are left alone. float16 is refused: the
    scaled latents would underflow."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.float16:
        raise HeadlabError("float16 cannot hold the latent-norm fold (the scaled latents underflow); use fp32 or bf16")
    folds = []
    for index, block in enumerate(model.model.layers):
        folds += fold_block_norms(block.self_attn, block.input_layernorm.weight, index, dtype, eps)
    return folds


def fold_block_norms(
    attn: nn.Module, gamma: torch.Tensor, index: int, dtype: torch.dtype, eps: float = LATENT_NORM_EPS
):
    """fold_latent_norm for one DeepseekV3Attention (`gamma`: its block's input-norm weight): each identity latent
    (and q_a) norm becomes an RMSNorm with the eps-dominance fold; returns the folds' records."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm  # start-up: lazy module

    pairs = [("kv_a_layernorm", attn.kv_a_proj_with_mqa, attn.kv_lora_rank, attn.kv_b_proj)]
    if attn.q_lora_rank is not None:
        pairs.append(("q_a_layernorm", attn.q_a_proj, attn.q_lora_rank, attn.q_b_proj))
    folds = []
    for name, proj, rows, reader in pairs:
        if not isinstance(getattr(attn, name), nn.Identity):
            continue
        fold = _fold_one(proj, rows, gamma, reader, eps)
        norm = DeepseekV3RMSNorm(rows, eps=eps).to(device=proj.weight.device, dtype=dtype)
        norm.weight.data.fill_(fold["norm_weight"])
        setattr(attn, name, norm)
        folds.append({"layer": index, "norm": name, **fold})
    return folds


@torch.no_grad()
def save_mla(mla: LoadedModel, out, record: dict, *, overwrite: bool = False, recovered: dict | None = None) -> dict:
    """Fold the latent norms (measuring the logits' change on a probe) and save with the record, verified by a
    vanilla AutoModelForCausalLM reload, with recovery/ (headlab.recovery.recover.write_recovery) when `recovered` is a
    recovery record. Returns what the record gains: fold, verification."""
    inputs = probe_inputs(mla.model)
    before = logits_of(mla.model, inputs)
    folds = fold_latent_norm(mla.model)
    diff = float((logits_of(mla.model, inputs) - before).abs().max()) if folds else 0.0
    alphas = [f["alpha"] for f in folds]
    fold = {
        "eps": LATENT_NORM_EPS,
        "norms_folded": len(folds),
        "alpha_range": [min(alphas), max(alphas)] if alphas else None,
        "max_abs_logit_diff": diff,
        "exact": False,
    }
    record = {**record, "latent_norm_fold": fold}

    def write_record(staging) -> None:
        write_recovery(staging / RECOVERY_DIR, recovered, f"recovery of {mla.spec}")

    extras = write_record if recovered is not None else None
    verification = save_with_record(mla, out, record, extras, overwrite=overwrite)
    return {"latent_norm_fold": fold, "verification": verification}


# ---- measuring --------------------------------------------------------------------------------------------------


def _output_projections(loaded: LoadedModel) -> list[nn.Module]:
    """Each attention layer's output projection: a converted model's o_proj, else the source's via its adapter."""
    latent = [m for m in loaded.model.modules() if hasattr(m, "kv_b_proj")]  # deepseek_v3 attention modules
    if latent:
        return [m.o_proj for m in latent]
    return [loaded.adapter.out_proj(layer) for layer in gqa_layers(loaded)]


@torch.no_grad()
def _compare(a: LoadedModel, b: LoadedModel, batches, tokens: int = 256, b_context=contextlib.nullcontext) -> dict:
    """On the first calibration window's first `tokens` tokens: max |logits_a - logits_b| and, per layer, the
    relative attention-output error ||o_b - o_a|| / ||o_a|| in the running models (errors compound over layers).
    b_context: entered around b's forward (the same model with its q/k norms constant: constant_qk_norms)."""
    input_ids, attention_mask, *_ = next(iter(batches))
    ids, mask = input_ids[:1, :tokens].to(a.device), attention_mask[:1, :tokens].to(a.device)
    outputs = ([], [])
    logits = []
    for side, (loaded, context) in enumerate(((a, contextlib.nullcontext), (b, b_context))):
        handles = [m.register_forward_hook(lambda _m, _i, out, s=side: outputs[s].append(out.float()))
                   for m in _output_projections(loaded)]  # fmt: skip
        try:
            with context():
                logits.append(loaded.model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float())
        finally:
            for handle in handles:
                handle.remove()
    errors = [float((ob - oa).norm() / oa.norm().clamp_min(1e-30)) for oa, ob in zip(*outputs)]
    return {"max_abs_logit_diff": float((logits[0] - logits[1]).abs().max()),
            "attention_output_rel_error_mean": sum(errors) / len(errors),
            "attention_output_rel_error_max": max(errors)}  # fmt: skip


def mla_kv_bytes_per_token(plan: MlaPlan, layers: int, dtype: torch.dtype) -> int:
    """(kv_lora_rank + rope_dim) numbers per token per layer: the latent and the shared rotary key."""
    return plan.cache_numbers * layers * torch.tensor([], dtype=dtype).element_size()


def _decoder_eps_diff(loaded: LoadedModel, mla: LoadedModel, batches) -> float:
    """max |logit diff| from running the decoder norms at the source's eps instead of the written 1e-6."""
    source_eps = getattr(loaded.model.config.get_text_config(), "rms_norm_eps", LATENT_NORM_EPS)
    norms = [m for n, m in mla.model.named_modules() if n.endswith("layernorm") or n.endswith("model.norm")]
    norms = [m for m in norms if hasattr(m, "variance_epsilon")]
    try:
        for m in norms:
            m.variance_epsilon = source_eps
        reference = _logits_first(mla.model, batches, mla.device)
    finally:
        for m in norms:
            m.variance_epsilon = LATENT_NORM_EPS
    return float((reference - _logits_first(mla.model, batches, mla.device)).abs().max())


@torch.no_grad()
def _logits_first(model, batches, device, tokens: int = 256) -> torch.Tensor:
    input_ids, attention_mask, *_ = next(iter(batches))
    ids, mask = input_ids[:1, :tokens].to(device), attention_mask[:1, :tokens].to(device)
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()


# ---- the conversion ------------------------------------------------------------------------------------------------


def convert_to_mla(
    loaded: LoadedModel,
    plan: MlaPlan,
    batches,
    *,
    progress: bool = True,
    grams: list[torch.Tensor] | None = None,
    mean_rotation: bool = True,
    phases: list[torch.Tensor] | None = None,
) -> tuple[LoadedModel, dict]:
    """Convert `loaded` (left untouched) to an MLA model in memory, calibrated on `batches` (calibration windows).
    A plan whose rope_dim is "measured" tries auto_rope_dims(plan) and keeps the lowest calibration NLL. Returns the
    converted LoadedModel (latent norms off) and the record: the plan, each step exact or approximate with its
    measured max |logit diff| and calibration NLL. mean_rotation: key parts that lose RoPE count with their mean
    rotation under each head's calibration attention (rope_phases; `phases` passes ones already gathered on `batches`);
    False keeps them as they are.
    A post-norm source (OLMo 2) is converted in its nearest pre-norm form (headlab.kv.post_norms), calibrated and
    compared in it; step post_norm_fold measures that form against the source."""
    pre_norm = PreNormForm.measure(loaded, batches, LATENT_NORM_EPS)
    if pre_norm is None:
        return _convert(loaded, plan, batches, progress, grams, mean_rotation, phases)
    nll_source = calibration_nll(loaded.model, batches, loaded.device)
    fold = _compare(loaded, loaded, batches, b_context=lambda: pre_norm.applied(loaded))
    with pre_norm.applied(loaded):  # Grams and phases a caller gathered on the source itself do not hold in the form
        mla, record = _convert(loaded, plan, batches, progress, None, mean_rotation, None, pre_norm)
    fold = {"exact": False, "how": "each post-norm replaced by its calibration RMS constant, folded into o_proj's and "
            "down_proj's rows; each raw sublayer input given deepseek_v3's norm at its calibration RMS", **fold,
            "calibration_nll": [nll_source, record["calibration_nll_before"]]}  # fmt: skip
    record["steps"] = {"post_norm_fold": fold, **record["steps"]}
    record["calibration_nll_before"] = nll_source
    return mla, record


def _convert(loaded, plan, batches, progress, grams, mean_rotation, phases, pre_norm=None):
    """convert_to_mla of a pre-norm source, or of a post-norm one running in `pre_norm`, its nearest pre-norm form."""
    grams = input_grams(loaded, batches, progress) if grams is None else grams
    if phases is None and mean_rotation:
        phases = rope_phases(loaded, batches, progress)
    phases = phases if mean_rotation else None
    device = loaded.device
    record = {"calibration_tokens": int(round(float(grams[0][-1, -1])))}
    nll_source = calibration_nll(loaded.model, batches, device)
    # one H x D x C^2 pass per layer: computed once for every build below (the rope-dim search builds up to five)
    multipliers = all_qk_norm_multipliers(loaded, grams)
    if plan.rope_choice == "measured":
        plan, searches = _measured_plan(loaded, plan, grams, phases, multipliers, batches, pre_norm)
        record.update(searches)
    mla = build_mla(loaded, plan, grams, phases, progress, qk_multipliers=multipliers, pre_norm=pre_norm)
    nll = calibration_nll(mla.model, batches, device)
    steps = {}
    if multipliers is not None:  # what the constant q/k norms cost on their own, in the source's modules

        def constant():
            return constant_qk_norms(loaded, multipliers)

        with constant():
            nll_fold = calibration_nll(loaded.model, batches, device)
        steps["qk_norm_fold"] = {
            "exact": False,
            "how": "each per-head q/k RMS norm replaced by its calibration RMS, g / sqrt(E[mean(y^2)] + eps), folded "
            "into the projection rows",
            **_compare(loaded, loaded, batches, b_context=constant),
            "calibration_nll": [nll_source, nll_fold],
        }
    steps |= _block_form_steps(loaded, mla)
    ratio = query_scale_ratio(loaded)
    steps |= {
        "rorope_rotation": {"exact": True, "how": "unitary mixing of KV heads per frequency commutes with RoPE"},
        "query_scale": {
            "exact": True,
            "how": f"sqrt((D + r) / D) folded into the query rows, r = {plan.rope_dim}"
            + ("" if ratio == 1.0 else f", with the source's softmax scale ({ratio:.6g} D^-0.5)")
            + ("" if mla.meta["rope"]["magnitude"] == [ratio] * 3 else ", with the RoPE magnitude"),
        },
    }
    # The steps are measured as a chain, each against the one before: source -> full-rank latent (RoPE truncation)
    # -> the latent at its rank -> the low-rank query; each intermediate build keeps the later steps exact.
    latent = mla
    if plan.q_lora_rank is not None:
        latent = build_mla(
            loaded, _replace(plan, q_lora_rank=None), grams, phases, qk_multipliers=multipliers, pre_norm=pre_norm
        )
    nll_latent = nll if latent is mla else calibration_nll(latent.model, batches, device)
    if plan.kv_lora_rank < plan.full_rank:
        full_plan = _replace(plan, kv_lora_rank=plan.full_rank, q_lora_rank=None)
        full = build_mla(loaded, full_plan, grams, phases, qk_multipliers=multipliers, pre_norm=pre_norm)
        nll_full = calibration_nll(full.model, batches, device)
        rope_diff, latent_diff = _compare(loaded, full, batches), _compare(full, latent, batches)
        del full
    else:
        nll_full, rope_diff = nll_latent, _compare(loaded, latent, batches)
        latent_diff = {"max_abs_logit_diff": 0.0, "attention_output_rel_error_mean": 0.0,
                       "attention_output_rel_error_max": 0.0}  # fmt: skip
    truncated = plan.num_kv_heads > 1 or plan.rope_dim < plan.rotary_dim or "sliding_window" in steps
    truncated = truncated or "layer_rope" in steps
    steps["rope_truncation"] = {"exact": not truncated, **rope_diff, "calibration_nll": [nll_source, nll_full],
                                "mean_rotation": mean_rotation}  # fmt: skip
    steps["latent_rank"] = {"exact": plan.kv_lora_rank >= plan.full_rank, **latent_diff,
                            "calibration_nll": [nll_full, nll_latent]}  # fmt: skip
    if latent is not mla:
        steps["query_rank"] = {"exact": False, **_compare(latent, mla, batches), "calibration_nll": [nll_latent, nll],
                               "how": f"the query through q_lora_rank {plan.q_lora_rank} (key-metric reduced-rank "
                                      "regression)"}  # fmt: skip
        del latent
    steps["decoder_norm_eps"] = {"exact": False, "max_abs_logit_diff": _decoder_eps_diff(loaded, mla, batches)}
    record["rope"] = mla.meta["rope"]
    record["parameters"] = {"source": _parameter_count(loaded.model), "converted": _parameter_count(mla.model)}
    record.update({"plan": plan.to_dict(), "steps": steps, "calibration_nll_before": nll_source,
                   "calibration_nll_after": nll, "layers": mla.meta["mla_layers"]})  # fmt: skip
    return mla, record


def _block_form_steps(loaded: LoadedModel, mla: LoadedModel) -> dict:
    """The record's steps for what the source's blocks hold that deepseek_v3's do not: a scaled embedding and 1 + w
    norms (exact folds); sliding windows and a second RoPE base (approximations, measured in rope_truncation, the
    step that compares the source with the full-rank model)."""
    steps = {}
    config = loaded.model.config.get_text_config()
    scale = embedding_scale(loaded)
    if scale != 1.0:
        steps["embedding_scale"] = {"exact": True, "how": f"the embedding's factor {scale:.6g} folded into its rows; "
                                    "the unembedding keeps the source's (untied)"}  # fmt: skip
    if loaded.adapter.norm_offset:
        steps["norm_offset"] = {"exact": True, "how": f"norms that scale by {loaded.adapter.norm_offset:g} + w "
                                "written with that sum as their weight"}  # fmt: skip
    window = window_of(config)
    if window:
        layers = [layer.block for layer in gqa_layers(loaded)
                  if layer_type_of(config, layer.block) in (None, SLIDING_ATTENTION)]  # fmt: skip
        steps["sliding_window"] = {
            "exact": False, "window": window, "layers": layers,
            "how": f"deepseek_v3 has no sliding window: these layers attend to every earlier token, the same on "
                   f"inputs up to {window} tokens; beyond them, measured in rope_truncation where the calibration "
                   "windows are longer",
        }  # fmt: skip
    changes = mla.meta["rope_frequency_change"]
    if changes:
        steps["layer_rope"] = {
            "exact": False, "max_relative_frequency_change": changes,
            "how": "layers with a RoPE of their own: each of deepseek_v3's rotary pairs carries the layer's pair of "
                   "nearest frequency and turns at deepseek_v3's (the full-attention layers'); measured in "
                   "rope_truncation",
        }  # fmt: skip
    return steps


def _parameter_count(model: nn.Module) -> int:
    """Distinct parameters (a tied lm_head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _measured_plan(loaded: LoadedModel, plan: MlaPlan, grams, phases, multipliers, batches, pre_norm=None):
    """(plan with its split measured and, below full rank, the split's key weight, {search: what it tried})."""
    plan, rope_tried = _search_rope_dim(loaded, plan, grams, phases, multipliers, batches, pre_norm)
    searches = {"rope_dim_search": rope_tried}
    if plan.kv_lora_rank < plan.full_rank:  # at full rank the latent is exact whatever its metric
        nll = min(t["calibration_nll"] for t in rope_tried)  # the chosen split's, built at weight 1
        plan, searches["key_weight_search"] = _search_key_weight(
            loaded, plan, nll, grams, phases, multipliers, batches, pre_norm
        )
    return plan, searches


def _search_rope_dim(loaded: LoadedModel, plan: MlaPlan, grams, phases, multipliers, batches, pre_norm=None):
    """(the candidate of auto_rope_dims(plan) with the lowest calibration NLL, every candidate tried with its NLL)."""
    tried = [{"rope_dim": candidate.rope_dim, "kv_lora_rank": candidate.kv_lora_rank,
              "calibration_nll": _candidate_nll(loaded, candidate, grams, phases, multipliers, batches, pre_norm)}
             for candidate in auto_rope_dims(plan)]  # fmt: skip
    best = min(tried, key=lambda t: t["calibration_nll"])
    return _replace(plan, rope_dim=best["rope_dim"], kv_lora_rank=best["kv_lora_rank"]), tried


def _search_key_weight(loaded: LoadedModel, plan: MlaPlan, nll: float, grams, phases, multipliers, batches,
                       pre_norm=None):  # fmt: skip
    """(plan with the KEY_WEIGHTS entry of lowest calibration NLL for its split, every weight tried with its NLL);
    `nll`: the plan's own, measured by the rope-dim search, so its weight is not built again."""
    tried = [{"key_weight": plan.key_weight, "calibration_nll": nll}]
    for weight in (w for w in KEY_WEIGHTS if w != plan.key_weight):
        candidate = _replace(plan, key_weight=weight)
        candidate_nll = _candidate_nll(loaded, candidate, grams, phases, multipliers, batches, pre_norm)
        tried.append({"key_weight": weight, "calibration_nll": candidate_nll})
    best = min(tried, key=lambda t: t["calibration_nll"])
    return _replace(plan, key_weight=best["key_weight"]), tried


def _candidate_nll(loaded: LoadedModel, plan: MlaPlan, grams, phases, multipliers, batches, pre_norm=None) -> float:
    """Calibration NLL of `plan` built in memory (the model dropped on return): one candidate of a measured choice."""
    model = build_mla(loaded, plan, grams, phases, qk_multipliers=multipliers, pre_norm=pre_norm).model
    return calibration_nll(model, batches, loaded.device)


@takes_text(split="eval", seq_len=512, batch_size=1, max_tokens=2048)
def convert_mla_checkpoint(
    loaded: LoadedModel,
    out,
    *,
    budget: str | None = None,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
    q_lora_rank: int | None = None,
    text: TextSpec,
    calibration_tokens: int = 2048,
    evaluate: bool = True,
    overwrite: bool = False,
    progress: bool = True,
    recovery=None,
) -> dict:
    """`headlab convert-mla`: validate -> measure before -> calibrate -> plan -> convert -> measure after ->
    recovery(mla) (a function LoadedModel -> record, may be None; it trains the norm-free model) -> fold + save,
    verified by a vanilla reload. Bad input fails before any work; the source is never modified.
    text: the eval text; calibration reads its calibration split (`calibration_tokens` tokens)."""
    check_checkpoint_out(out, overwrite, loaded.source)
    plan = plan_mla(loaded, budget, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, q_lora_rank=q_lora_rank)
    text = text.resolved()
    record = {"model": loaded.spec, "source": loaded.source, "target": "deepseek_v3 (MLA)"}
    layers = len(gqa_layers(loaded))
    record["kv_bytes_per_token_before"] = kv_bytes_per_token(loaded)
    record["measured_kv_bytes_per_token_before"] = measured_kv_bytes_per_token(loaded)
    if evaluate:
        record["perplexity_before"] = perplexity(loaded, text=text, progress=progress).to_dict()
    calibration = text.but(split="calibration", max_tokens=calibration_tokens, batch_size=4)
    batches = calibration.batches(loaded.tokenizer, max_positions=loaded.max_positions)
    record["calibration"] = batches.meta
    mla, converted = convert_to_mla(loaded, plan, batches, progress=progress)
    record.update(converted)
    plan = MlaPlan(**{k: v for k, v in converted["plan"].items() if k in MlaPlan.__dataclass_fields__})
    record["kv_bytes_per_token_after"] = mla_kv_bytes_per_token(plan, layers, loaded.dtype)
    record["measured_kv_bytes_per_token_after"] = measured_kv_bytes_per_token(mla)
    if evaluate:
        record["perplexity_after"] = perplexity(mla, text=text, progress=progress).to_dict()
        record["eval"] = {"data": text.corpus_name, "part": text.split, "seq_len": text.seq_len,
                          "max_tokens": text.max_tokens}  # fmt: skip
    recovered = None
    if recovery is not None:
        recovered = recovery(mla)  # trains the norm-free model; the norms are folded in by save_mla
        record["recovery"] = {k: v for k, v in recovered.items() if k != "tables"}
        if evaluate:
            record["perplexity_recovered"] = perplexity(mla, text=text, progress=progress).to_dict()
    record.update(save_mla(mla, out, record, overwrite=overwrite, recovered=recovered))
    record["out"] = str(out)
    return record
