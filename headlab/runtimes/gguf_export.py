"""GGUF export for llama.cpp: any llama-family checkpoint headlab loads or writes (original, uniformly or per-layer
pruned, KV-reduced) and dense MLA (deepseek_v3) checkpoints, with its tokenizer and chat template, in f32/f16/bf16, a type the gguf package
quantizes in numpy (q8_0, q4_0, ...), or a llama.cpp file type its own quantizer writes (q4_k_m, q6_k, iq4_nl, ...:
written as f32 beside the output, then llama_model_quantize; see `check_type` for which path a name takes).

Which llama.cpp architecture runs which layout (read from llama.cpp's loader, src/llama-model.cpp and src/models/):
- every architecture reads `head_count` / `head_count_kv` as a scalar or a per-layer array (`get_key_or_arr`), but
  the `llama`, `qwen2` and `qwen3` graphs reshape every layer with the layer-0 count (`hparams.n_head()`), so they
  run uniform layouts only; `qwen2` also sizes q and o as `n_embd` wide (a uniformly pruned qwen2 does not fit);
- `deci` (DeciLM / Llama-3.1-Nemotron) builds each layer with `hparams.n_head(il)`, `n_head_kv(il)`: a llama graph
  (RMSNorm, SwiGLU, optional q/k/v/o biases, rope_freqs) with per-layer attention shapes. Non-uniform layouts go
  there; it has no per-head q/k norm, so a qwen3 with per-layer head counts cannot run in llama.cpp.
- `llama` and `deci` rotate adjacent pairs (2i, 2i+1) ("normal" RoPE); transformers rotates i with i + d/2
  (rotate_half), so q and k rows (and biases) are permuted within each head for them (llama.cpp's
  convert_hf_to_gguf does the same); `qwen2`/`qwen3` use the rotate_half ("neox") convention and are written as is.
- `deepseek2` runs multi-head latent attention: deepseek_v3 checkpoints with a dense MLP in every block (what
  convert-mla writes) go there as convert_hf_to_gguf's DeepseekV2Model writes them: MQA over the latent (key length
  kv_lora_rank + rope, value length kv_lora_rank), kv_b_proj split into attn_k_b (transposed) and attn_v_b, the
  rotary rows unpermuted (rope_interleave already gives consecutive pairs). Its graph always applies the latent
  RMSNorm with rms_norm_eps, and its loader asserts qk_nope_head_dim >= 1 (docs/runtimes.md). It runs default RoPE
  linear scaling and DeepSeek's yarn (rope.scaling.* keys), never rope_freqs: llama3-scaled MLA is refused
  (_mla_rope_problem).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from headlab import __version__
from headlab.core.errors import HeadlabError
from headlab.core.fsio import GGUF_MARK, atomic_file, check_free_space, check_out, check_output_name, scratch_file
from headlab.core.loading import LoadedModel, available_memory, weights_in_memory
from headlab.core.units import human_bytes
from headlab.mechanisms.hooks import input_grams
from headlab.runtimes import llamacpp
from headlab.runtimes.choices import DEFAULT_TYPE, GPTQ_TYPES, IMATRIX_TYPES, LLAMACPP_ALIASES, LLAMACPP_TYPES
from headlab.runtimes.gptq import GptqRounding
from headlab.runtimes.imatrix import input_mean_squares
from headlab.runtimes.smoothing import DEFAULT_ALPHA, Smoothing, activation_smoothing, check_alpha

# Tensor types: the float ones are written by numpy; any other ggml type only if gguf.quants can quantize it.
FLOAT_TYPES = ("f32", "f16", "bf16")
# The type a llama.cpp-quantized export is first written in: f32 is the weights exactly (a bf16 or f32 checkpoint
# rounded to f16 first would be rounded twice, and bf16's range exceeds f16's), at 4 bytes a parameter of scratch disk.
QUANTIZE_FROM = "f32"

_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.down_proj.bias": "ffn_down.bias",
    # multi-head latent attention (deepseek_v3 -> deepseek2); kv_b is split into attn_k_b / attn_v_b when written
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
}
_BLOCK_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_CORE = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"}
_FFN = {"ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
_BIASES = {"attn_q.bias", "attn_k.bias", "attn_v.bias"}
_LLAMA_LOADS = frozenset(_CORE | _FFN | _BIASES | {"attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"})


@dataclass(frozen=True)
class Target:
    """A llama.cpp architecture as its loader and graph read it (src/models/<arch>.cpp)."""

    arch: str
    per_layer_heads: bool  # the graph reads n_head(il) / n_head_kv(il)
    interleaved_rope: bool  # "normal" RoPE on pairs (2i, 2i+1): q/k rows are permuted from rotate_half order
    full_width_q: bool  # q and o are sized n_embd: needs heads x head_dim == hidden size
    rope_freqs: bool  # reads a rope_freqs tensor (llama3 / linear RoPE scaling as per-frequency divisors)
    loads: frozenset  # block tensor names (without "blk.N.") it reads


TARGETS = {
    "llama": Target("llama", False, True, False, True, _LLAMA_LOADS),
    "deci": Target("deci", True, True, False, True, _LLAMA_LOADS),
    "qwen2": Target("qwen2", False, False, True, False, frozenset(_CORE - {"attn_output.bias"} | _FFN | _BIASES)),
    "qwen3": Target(
        "qwen3",
        False,
        False,
        False,
        False,
        frozenset(_CORE | _FFN | _BIASES | {"attn_q_norm.weight", "attn_k_norm.weight"}),
    ),
}
# llama.cpp's deepseek2 (src/models/deepseek2.cpp): MLA attention, dense SwiGLU for the leading dense blocks. Weights
# as transformers holds them with rope_interleave (consecutive-pair RoPE, llama.cpp's "normal" type): no permutation.
_MLA_LOADS = frozenset(
    {"attn_norm.weight", "attn_q.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"}
    | {"attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_kv_b.weight", "attn_output.weight"}
    | _FFN
)
TARGETS["deepseek2"] = Target("deepseek2", False, False, False, False, _MLA_LOADS)
# transformers model_type -> llama.cpp architectures to try, in order of preference.
FAMILIES = {
    "llama": ("llama", "deci"),
    "mistral": ("llama", "deci"),
    "qwen2": ("qwen2", "deci"),
    "qwen3": ("qwen3",),
    "deepseek_v3": ("deepseek2",),
}
# deepseek2's loader takes a 26-, 27- or 48-layer model (with a 128,256-token vocabulary for 48) for a "lite" one and
# then never reads q_lora_rank (llama_model_deepseek2::load_arch_hparams): a query LoRA there would not load.
_LITE_LAYERS = {26: None, 27: None, 48: 128256}
ROPE_TYPES = ("default", "linear", "llama3")  # frequency-only RoPE variants llama.cpp reproduces exactly

# Byte-level BPE pre-tokenizers llama.cpp implements (src/llama-vocab.cpp), identified by tokenizer.json's regex.
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass
class ExportPlan:
    """What will be written: architecture, per-layer heads, and anything the user should know."""

    target: Target
    model_type: str
    heads: list[int]
    kv_heads: list[int]
    head_dim: int
    rope_freqs: list[float] | None
    notes: list[str] = field(default_factory=list)
    # Layers whose attention adds nothing (every head pruned: zero output projection, no bias), written with 0 heads
    # and no attention tensors: llama.cpp's deci graph skips them and caches no keys or values for them.
    attention_free: list[int] = field(default_factory=list)
    # GGUF tensor names (the part after "blk.N.") written in f32 whatever the file type (KEEP_F32_WHY says why).
    keep_f32: tuple[str, ...] = ()

    def kept_f32(self, gguf_name: str) -> bool:
        return gguf_name.split(".", 2)[-1] in self.keep_f32

    @property
    def uniform(self) -> bool:
        return len(set(zip(self.heads, self.kv_heads))) == 1


class _OffloadedTensor:
    """A weight a device map keeps offloaded (a meta placeholder until its module runs): its shape for the GGUF
    header, and a CPU copy read in with its module (weights_in_memory) only when its bytes are written, so an export
    under `--device-map auto --max-memory` holds one tensor of it at a time."""

    def __init__(self, module: torch.nn.Module, attribute: str, shape: torch.Size):
        self.module, self.attribute, self.shape = module, attribute, shape

    def read(self) -> torch.Tensor:
        with weights_in_memory(self.module):
            # the tensor accelerate read in stays alive through this reference when the module goes back to meta
            return getattr(self.module, self.attribute).detach().to("cpu")


def _resident(tensor) -> torch.Tensor:
    return tensor.read() if isinstance(tensor, _OffloadedTensor) else tensor


def _gguf_names(model) -> dict[str, tuple[str, int | None, torch.Tensor]]:
    """HF state-dict name -> (GGUF name, block index, tensor); a tied output head is left out (llama.cpp reuses
    token_embd). Unknown tensors are refused: writing a file that silently drops weights would run wrong. A weight
    a device map offloaded comes as an _OffloadedTensor, read when it is written."""
    state = model.state_dict()
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    # by identity: an offloaded (meta) weight has no storage whose address could show the tie
    tied = head is not None and embeddings is not None and head.weight is embeddings.weight
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and tied:
            continue
        if tensor.device.type == "meta":
            owner, _, attribute = name.rpartition(".")
            tensor = _OffloadedTensor(model.get_submodule(owner), attribute, tensor.shape)
        if name in _TOP_NAMES:
            out[name] = (_TOP_NAMES[name], None, tensor)
            continue
        match = _BLOCK_RE.fullmatch(name)
        if not match or match.group(2) not in _BLOCK_NAMES:
            raise HeadlabError(f"tensor {name} has no GGUF counterpart in the llama family; cannot export this model")
        block = int(match.group(1))
        out[name] = (f"blk.{block}.{_BLOCK_NAMES[match.group(2)]}", block, tensor)
    return out


def _rope_freqs(loaded: LoadedModel, head_dim: int) -> tuple[list[float] | None, str | None]:
    """Per-frequency divisors of llama.cpp's rope_freqs tensor (theta_i = base^(-2i/d) / rope_freqs[i]) that turn
    the default RoPE into the model's (linear and llama3 scaling only change frequencies); None when default."""
    config = loaded.model.config.get_text_config()
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        return None, f"RoPE type {rope_type!r} (llama.cpp reproduces only {', '.join(ROPE_TYPES)} exactly)"
    if rope_type == "default":
        return None, None
    rotary = next((m for m in loaded.model.modules() if hasattr(m, "inv_freq")), None)
    if rotary is None or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return None, f"RoPE type {rope_type!r} with an attention scaling factor"
    base = float(rope["rope_theta"])
    default = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # [d/2]
    return (default / rotary.inv_freq.double().cpu()).tolist(), None


def plan_export(loaded: LoadedModel) -> ExportPlan:
    """Choose the llama.cpp architecture for this checkpoint or refuse in one line saying why."""
    config = loaded.model.config.get_text_config()
    model_type = config.model_type
    if model_type not in FAMILIES:
        raise HeadlabError(
            f"export-gguf covers the llama family and MLA ({', '.join(FAMILIES)}); {model_type!r} is not one of them"
        )
    if loaded.adapter.norm_spans_heads:
        raise HeadlabError(f"{model_type}: a q/k norm spanning heads has no llama.cpp counterpart")
    if loaded.adapter.latent_kv:
        return _plan_mla(loaded, config)
    layers = loaded.layers
    head_dims = {layer.head_dim for layer in layers}
    if len(head_dims) != 1:
        raise HeadlabError("layers with different head sizes cannot be described to llama.cpp")
    head_dim = head_dims.pop()
    if loaded.adapter.rotary_dim(layers[0], config) != head_dim:
        raise HeadlabError("partial rotary embeddings: llama.cpp's llama-family graphs rotate the whole head")
    heads = [layer.num_heads for layer in layers]
    kv_heads = [layer.num_kv_heads for layer in layers]
    names = {gguf.split(".", 2)[-1] for gguf, block, _ in _gguf_names(loaded.model).values() if block is not None}
    rope_freqs, rope_problem = _rope_freqs(loaded, head_dim)
    if rope_problem:
        raise HeadlabError(f"{model_type}: {rope_problem} cannot be exported to llama.cpp")
    # An emptied layer keeps one zero-output padding head in transformers; a per-layer graph can drop it entirely.
    # Not layer 0: llama.cpp reads the head size (key_length, rope dims) only when layer 0 has heads.
    free = [i for i, layer in enumerate(layers) if i > 0 and _attention_is_zero(loaded, layer)]
    if not any(TARGETS[arch].per_layer_heads for arch in FAMILIES[model_type]):
        free = []
    if free:
        heads = [0 if i in free else h for i, h in enumerate(heads)]
        kv_heads = [0 if i in free else g for i, g in enumerate(kv_heads)]
    uniform = len(set(zip(heads, kv_heads))) == 1
    reasons = []
    for arch in FAMILIES[model_type]:
        target = TARGETS[arch]
        if not uniform and not target.per_layer_heads:
            why = "attention-free layers" if free else "layer 0's head counts"
            reasons.append(f"{arch}: its graph builds every layer with {why}")
        elif target.full_width_q and heads[0] * head_dim != config.hidden_size:
            reasons.append(f"{arch}: q/o must be hidden-size wide ({heads[0]} x {head_dim} != {config.hidden_size})")
        elif names - target.loads:
            reasons.append(f"{arch}: does not read {', '.join(sorted(names - target.loads))}")
        elif rope_freqs is not None and not target.rope_freqs:
            reasons.append(f"{arch}: has no rope_freqs tensor for scaled RoPE")
        else:
            notes = []
            window = getattr(config, "sliding_window", None)
            if window and getattr(config, "use_sliding_window", True) and window < (loaded.max_positions or 0):
                notes.append(
                    f"llama.cpp's {arch} graph attends over the whole context: identical to transformers only "
                    f"up to the sliding window ({window} tokens)"
                )
            if free:
                notes.append(f"layers {free} have no attention left: written with 0 heads, no KV cache for them")
            return ExportPlan(target, model_type, heads, kv_heads, head_dim, rope_freqs, notes, free)
    raise HeadlabError(f"llama.cpp cannot run this {model_type} layout: " + "; ".join(reasons))


def _attention_is_zero(loaded: LoadedModel, layer) -> bool:
    """The layer's attention adds exactly nothing to the residual stream: output projection and bias all zero."""
    with weights_in_memory(layer.module):  # a device map may have offloaded it
        weights = loaded.adapter.read(layer)
        return not bool(weights.o.any()) and (weights.o_bias is None or not bool(weights.o_bias.any()))


def _plan_mla(loaded: LoadedModel, config) -> ExportPlan:
    """deepseek_v3 -> llama.cpp's deepseek2, or a one-line refusal naming what its loader or graph cannot express."""
    layers, model_type = loaded.layers, config.model_type
    L = len(layers)
    problems = []
    if (config.first_k_dense_replace or 0) < L:
        problems.append(f"MoE layers (first_k_dense_replace {config.first_k_dense_replace} < {L} layers): headlab "
                        "exports dense-MLP MLA models only")  # fmt: skip
    if any(getattr(layer.module.kv_a_layernorm, "weight", None) is None for layer in layers):
        problems.append("an identity latent norm: llama.cpp's deepseek2 graph always applies the RMSNorm to the latent "
                        "(fold it into the weights first)")  # fmt: skip
    if float(config.rms_norm_eps) != 1e-6:
        problems.append(f"rms_norm_eps {config.rms_norm_eps}: llama.cpp applies it to the latent norm too, which "
                        "transformers computes with eps 1e-6")  # fmt: skip
    if config.hidden_act != "silu":  # an MLA from Gemma 3 keeps its GELU MLP
        problems.append(f"hidden_act {config.hidden_act}: llama.cpp's deepseek2 graph runs a SiLU-gated MLP")
    if config.qk_nope_head_dim < 1:
        problems.append("qk_nope_head_dim 0: llama.cpp's deepseek2 loader asserts at least one non-rotary key dim")
    if not config.rope_interleave:
        problems.append("rope_interleave false (llama.cpp's deepseek2 rotates consecutive pairs)")
    rope_problem = _mla_rope_problem(getattr(config, "rope_parameters", None) or {})
    if rope_problem:
        problems.append(rope_problem)
    if config.q_lora_rank and L in _LITE_LAYERS and _LITE_LAYERS[L] in (None, config.vocab_size):
        problems.append(f"a query LoRA in {L} layers: llama.cpp takes this depth for a 'lite' model without one")
    heads = [layer.num_heads for layer in layers]
    if len(set(heads)) != 1:
        problems.append("per-layer head counts (the deepseek2 graph builds every layer with layer 0's)")
    if problems:
        raise HeadlabError(f"llama.cpp cannot run this {model_type} model: " + "; ".join(problems))
    # After the checks above: _gguf_names refuses unknown tensors (MoE experts) with a less telling message.
    names = {gguf.split(".", 2)[-1] for gguf, block, _ in _gguf_names(loaded.model).values() if block is not None}
    if names - _MLA_LOADS:
        raise HeadlabError(f"llama.cpp's deepseek2 does not read {', '.join(sorted(names - _MLA_LOADS))}")
    notes = ["MLA cache in llama.cpp: kv_lora_rank + qk_rope_head_dim numbers per token and layer (the latent)"]
    plan = ExportPlan(TARGETS["deepseek2"], model_type, heads, [1] * L, layers[0].head_dim, None, notes)
    plan.keep_f32 = MLA_KEEP_F32
    return plan


# The latent-norm fold (headlab.kv.mla.fold_latent_norm) scales the latent down-projections by a power of two near
# 2^-20 so that deepseek2's RMSNorm acts linearly on the latent. f16 and the f16 block scales of every quantized type
# flush such weights to zero (measured: MLA at the MQA budget, perplexity 91 -> 24,918 as q8_0), so these matrices
# stay f32 in any file type: a few MiB.
MLA_KEEP_F32 = ("attn_kv_a_mqa.weight", "attn_q_a.weight")


def _mla_rope_problem(rope: dict) -> str | None:
    """Why llama.cpp's deepseek2 cannot run this RoPE exactly, or None. It runs default RoPE, linear scaling (every
    frequency divided by the factor: the loader's freq_scale; rotary rows written times linear_rope_prescale) and yarn
    in DeepSeek's own form: mscale = mscale_all_dim (M), no explicit attention_factor, which transformers' deepseek_v3 and
    llama.cpp both compute as cos/sin unscaled and a softmax scale times (1 + 0.1 M ln factor)^2 (transformers:
    yarn_apply_mscale; llama.cpp: llama_context's yarn_attn_factor, cancelled and moved into kq_scale by
    src/models/deepseek2.cpp). Its graph hands ggml_rope_ext no frequency factors, so llama3 cannot run there."""
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return ("llama3 RoPE scaling: llama.cpp's deepseek2 graph applies RoPE without frequency factors (no "
                "rope_freqs tensor), so llama3's per-frequency scaling cannot be expressed there")  # fmt: skip
    if rope_type == "linear":  # every frequency divided by the factor: ggml_rope_ext's freq_scale, in any graph
        return None if float(rope.get("factor") or 0) > 0 else "linear RoPE scaling without a positive factor"
    if rope_type != "yarn":
        return f"RoPE type {rope_type!r} (llama.cpp's deepseek2 runs default, linear and yarn RoPE)"
    if rope.get("attention_factor") is not None or not rope.get("mscale_all_dim"):
        return "yarn without mscale_all_dim or with an explicit attention_factor (deepseek2 reads only mscale_all_dim)"
    if rope.get("mscale") != rope.get("mscale_all_dim"):
        return "yarn with mscale != mscale_all_dim (llama.cpp's deepseek2 takes them equal)"
    if float(rope.get("factor") or 0) <= 1:
        return "yarn with factor <= 1 (llama.cpp's mscale is then not transformers')"
    if (rope.get("beta_fast") or 32) != 32 or (rope.get("beta_slow") or 1) != 1 or rope.get("truncate") is False:
        return ("yarn with a correction range other than beta_fast 32 / beta_slow 1 rounded to whole dims (ggml "
                "always rounds it, and llama-cpp-python passes its own betas): convert-mla at rope_dim < rotary "
                "dims writes one; convert at the full rotary dims")  # fmt: skip
    return None


def _mla_hparams(writer, config) -> None:
    """deepseek2's keys (convert_hf_to_gguf's DeepseekV2Model): MLA seen as MQA over the latent (key length
    kv_lora_rank + rope, value length kv_lora_rank), the per-head sizes as *_mla keys, every block dense."""
    rank, rope = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
    writer.add_kv_lora_rank(rank)
    writer.add_q_lora_rank(int(config.q_lora_rank or 0))  # 0: one q_proj; the non-lite loader requires the key
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(int(config.qk_nope_head_dim) + rope)
    writer.add_value_length_mla(int(config.v_head_dim))
    writer.add_rope_dimension_count(rope)
    writer.add_leading_dense_block_count(int(config.num_hidden_layers))
    writer.add_expert_feed_forward_length(int(config.intermediate_size))  # read unconditionally, unused when dense
    writer.add_expert_shared_count(0)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "linear":  # llama.cpp: freq_scale = 1 / factor; no attention factor (log mul 0)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if rope.get("rope_type") == "yarn":  # _mla_rope_problem let only DeepSeek's own yarn form through
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        # 0.1 x mscale_all_dim, as convert_hf_to_gguf writes it; llama.cpp's deepseek2 loader divides the 0.1 back out
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))


def _split_kv_b(items: list, config) -> list:
    """attn_kv_b [H*(nope+Dv), R] -> attn_k_b [H, R, nope] (transposed: llama.cpp absorbs it into the query) and
    attn_v_b [H, Dv, R], as convert_hf_to_gguf writes them for MLA."""
    nope, Dv = int(config.qk_nope_head_dim), int(config.v_head_dim)
    out = []
    for name, block, tensor in items:
        if not name.endswith("attn_kv_b.weight"):
            out.append((name, block, tensor))
            continue
        kv_b = _resident(tensor).detach().reshape(-1, nope + Dv, tensor.shape[-1])  # [H, nope + Dv, R]
        k_b, v_b = kv_b.split([nope, Dv], dim=1)
        out.append((name.replace("attn_kv_b", "attn_k_b"), block, k_b.transpose(1, 2).contiguous()))
        out.append((name.replace("attn_kv_b", "attn_v_b"), block, v_b.contiguous()))
    return out


def linear_rope_prescale(config) -> float:
    """The factor deepseek2's rotary query and key rows are written times under linear RoPE scaling: 1 / c with
    c = 1 + 0.1 ln(factor), 1.0 for any other RoPE. llama.cpp's deepseek2 graph adjusts the rope's attention factor
    and the softmax scale for yarn's magnitude (src/models/deepseek2.cpp); under linear scaling, which adds no
    magnitude, its rotated queries and keys come out c times transformers' (measured: factor 8, perplexity 1.1%
    apart unscaled, 2e-9 with rows divided by c; a factor c instead gives 1.6%). The rope is linear in its input,
    so dividing the rows undoes it exactly up to one rounding of each weight."""
    rope = getattr(config, "rope_parameters", None) or {}
    return 1.0 / (1.0 + 0.1 * math.log(float(rope["factor"]))) if rope.get("rope_type") == "linear" else 1.0


def _prescale_rope_rows(items: list, config) -> list:
    """Query rows (attn_q or attn_q_b, [H * (nope + rope), .]) and the rotary key rows of attn_kv_a_mqa
    ([R + rope, C]) whose rotary part is multiplied by linear_rope_prescale; the items unchanged when it is 1."""
    scale = linear_rope_prescale(config)
    if scale == 1.0:
        return items
    nope, rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
    out = []
    for name, block, tensor in items:
        kind = name.split(".")[2] if block is not None else ""
        if kind in ("attn_q", "attn_q_b"):
            heads = _resident(tensor).detach().reshape(-1, nope + rope, *tensor.shape[1:]).clone()
            heads[:, nope:] *= scale
            tensor = heads.reshape(tensor.shape)
        elif kind == "attn_kv_a_mqa":
            tensor = _resident(tensor).detach().clone()
            tensor[-rope:] *= scale
        out.append((name, block, tensor))
    return out


def interleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of q/k (or their biases) from rotate_half order (dim i pairs with i + d/2, transformers) to adjacent
    pairs (2i, 2i+1, llama.cpp "normal" RoPE): within each head, new row 2i = old row i, new row 2i+1 = old i + d/2."""
    d = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, d // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# ---- tensor types -------------------------------------------------------------------------------------------------


def writable_types() -> list[str]:
    """Tensor types this gguf package can write: the float types plus every type gguf.quants quantizes in numpy."""
    out = list(FLOAT_TYPES)
    sample = np.linspace(-1, 1, 256 * 4, dtype=np.float32).reshape(4, 256)
    for qtype in gguf.GGMLQuantizationType:
        name = qtype.name.lower()
        if name in out or name in ("f64", "i8", "i16", "i32", "i64"):
            continue
        try:
            gguf.quants.quantize(sample, qtype)
        except (NotImplementedError, ValueError, KeyError, AssertionError, TypeError):
            continue
        out.append(name)
    return out


def check_type(outtype: str, imatrix: bool = False, gptq: bool = False) -> str:
    """The output type's canonical name, or a one-line refusal. Which path writes it: a name in LLAMACPP_TYPES (a
    llama.cpp file type, llama-quantize's name, its aliases q3_k/q4_k/q5_k included) is written as f32 and quantized
    by llama.cpp, which needs llama-cpp-python, and so is a name in IMATRIX_TYPES, which llama.cpp writes only with an
    importance matrix (`imatrix`); any other name must be a tensor type headlab writes itself with the gguf package
    (the floats and what gguf.quants quantizes in numpy: q8_0, q4_0, q4_1, q5_0, q5_1, ...), every matrix in that
    type, which an importance matrix cannot weight. Q8_0 stays there: llama.cpp's Q8_0 file is byte-identical in
    every tensor (its Q8_0 rounding takes no importance matrix either). `gptq` takes GPTQ_TYPES, and llama.cpp
    file types (GPTQ then rounds the matrices their recipe puts in GPTQ_TYPES)."""
    outtype = LLAMACPP_ALIASES.get(outtype.lower(), outtype.lower())
    if gptq and outtype not in GPTQ_TYPES and not llamacpp_ftype(outtype):
        raise HeadlabError(
            f"GPTQ rounds ggml's symmetric block types ({', '.join(GPTQ_TYPES)}), written by headlab or chosen by "
            f"llama.cpp's recipe for a file type, and outtype={outtype!r} is neither; drop --gptq"
        )
    if outtype in IMATRIX_TYPES and not imatrix:
        raise HeadlabError(
            f"outtype={outtype!r}: llama.cpp quantizes it only with an importance matrix (add --imatrix)"
        )
    if llamacpp_ftype(outtype):
        if llamacpp.unavailable() is not None:
            raise HeadlabError(
                f"outtype={outtype!r} is quantized by llama.cpp and llama-cpp-python does not import here; "
                "pip install 'headlab[llamacpp]'"
            )
        return outtype
    if imatrix:
        raise HeadlabError(
            f"an importance matrix weights llama.cpp's quantizer, and outtype={outtype!r} is not one of its types "
            f"({', '.join([*LLAMACPP_TYPES, *IMATRIX_TYPES])}); drop --imatrix"
        )
    if outtype in FLOAT_TYPES:
        return outtype
    choices = writable_types()
    if outtype not in choices:
        raise HeadlabError(
            f"outtype={outtype!r} is not a type export-gguf writes; use one of {', '.join(choices)} (written by "
            f"headlab) or {', '.join(LLAMACPP_TYPES)} (quantized by llama.cpp; with --imatrix also "
            f"{', '.join(IMATRIX_TYPES)})"
        )
    return outtype


def llamacpp_ftype(outtype: str) -> str | None:
    """The LLAMA_FTYPE_MOSTLY_* suffix of a llama.cpp file type, None for a type headlab writes itself."""
    return LLAMACPP_TYPES.get(outtype) or IMATRIX_TYPES.get(outtype)


def _tensor_type(outtype: str, name: str, shape: tuple[int, ...]):
    """The ggml type one tensor is written in: vectors (norms, biases, rope_freqs) stay f32 as in llama.cpp's
    converter; a matrix whose rows do not split into the quantized type's blocks falls back to f16."""
    if len(shape) == 1 or outtype == "f32":
        return gguf.GGMLQuantizationType.F32
    qtype = gguf.GGMLQuantizationType[outtype.upper()]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return qtype


def _encode(array: np.ndarray, qtype) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array.astype(np.float32), qtype)


# ---- tokenizer ----------------------------------------------------------------------------------------------------


def _pre_tokenizer(spec: dict | None) -> tuple[str | None, str | None]:
    """llama.cpp's name for a byte-level BPE pre-tokenizer ("gpt-2", "smollm", "llama-bpe", "qwen2"), from
    tokenizer.json; (None, problem) when the tokenizer is not byte-level BPE or has another pre-tokenizer."""
    parts = spec.get("pretokenizers", []) if spec and spec.get("type") == "Sequence" else [spec] if spec else []
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2", None
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm", None
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        pattern = (parts[0].get("pattern") or {}).get("Regex")
        for name, regex in (("llama-bpe", _LLAMA3_SPLIT), ("qwen2", _QWEN2_SPLIT)):
            if pattern == regex:
                return name, None
    if "ByteLevel" in kinds:
        return "default", "its pre-tokenizer is not one llama.cpp implements: llama.cpp splits text its default way"
    return None, f"pre-tokenizer {kinds or 'none'}"


def _tokenizer_fields(tokenizer, vocab_size: int) -> tuple[dict, list[str]]:
    """GGUF tokenizer metadata for a byte-level BPE tokenizer (vocabulary type "gpt2" in llama.cpp)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise HeadlabError("export-gguf needs a fast (tokenizers) tokenizer to write the vocabulary")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    pre, problem = _pre_tokenizer(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or pre is None:
        raise HeadlabError(
            f"tokenizer {model.get('type')} with {problem or 'byte fallback'}: export-gguf writes byte-level BPE "
            "vocabularies (SmolLM2, Llama 3, Qwen, GPT-2 style) only"
        )
    notes = [f"tokenizer: {problem}"] if problem else []
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise HeadlabError(f"the tokenizer has ids up to {max(vocab.values())} but the model only {vocab_size} rows")
    by_id = {i: token for token, i in vocab.items()}
    added = {i: entry for i, entry in tokenizer.added_tokens_decoder.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])]
    probe = tokenizer("a").input_ids
    fields = {
        "model": "gpt2",
        "pre": pre,
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "special": {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "unk", "pad")},
        # What transformers does when asked to add special tokens: llama.cpp repeats it when it tokenizes.
        "add_bos": bool(probe) and probe[0] == tokenizer.bos_token_id,
        "add_eos": bool(probe) and probe[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id is not None,
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return fields, notes


def _add_tokenizer(writer, fields: dict) -> None:
    writer.add_tokenizer_model(fields["model"])
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    writer.add_token_merges(fields["merges"])
    setters = {
        "bos": writer.add_bos_token_id,
        "eos": writer.add_eos_token_id,
        "unk": writer.add_unk_token_id,
        "pad": writer.add_pad_token_id,
    }
    for name, token_id in fields["special"].items():
        if token_id is not None:
            setters[name](int(token_id))
    writer.add_add_bos_token(fields["add_bos"])
    writer.add_add_eos_token(fields["add_eos"])
    if isinstance(fields["chat_template"], str):
        writer.add_chat_template(fields["chat_template"])


# ---- writing ------------------------------------------------------------------------------------------------------


def _hparams(writer, plan: ExportPlan, config, loaded: LoadedModel, file_type: int) -> None:
    writer.add_name(str(getattr(config, "name_or_path", "") or loaded.spec))
    writer.add_block_count(len(plan.heads))
    writer.add_context_length(int(loaded.max_positions or 0))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_feed_forward_length(int(config.intermediate_size))
    if plan.uniform:
        writer.add_head_count(plan.heads[0])
        writer.add_head_count_kv(plan.kv_heads[0])
    else:  # per-layer arrays (llama.cpp get_key_or_arr); only per-layer architectures read them layer by layer
        writer.add_head_count(plan.heads)
        writer.add_head_count_kv(plan.kv_heads)
    if plan.target.arch == "deepseek2":
        _mla_hparams(writer, config)
    else:
        # llama.cpp derives the head size as n_embd / n_head unless told: pruned layouts must say it.
        writer.add_key_length(plan.head_dim)
        writer.add_value_length(plan.head_dim)
        writer.add_rope_dimension_count(plan.head_dim)
    writer.add_rope_freq_base(float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    writer.add_file_type(file_type)


def _rope_heads(plan: ExportPlan, gguf_name: str, block: int | None) -> int | None:
    """The head count whose rows llama.cpp wants permuted to its interleaved RoPE (q: query heads, k: KV heads), or
    None for a tensor written as it is."""
    if not plan.target.interleaved_rope or block is None:
        return None
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return plan.heads[block]
    if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return plan.kv_heads[block]
    return None


def _converted(plan: ExportPlan, gguf_name: str, block: int | None, tensor: torch.Tensor) -> np.ndarray:
    """The tensor as llama.cpp reads it: float32 numpy, q/k rows permuted for interleaved-RoPE architectures."""
    data = tensor.detach().to("cpu", torch.float32)
    heads = _rope_heads(plan, gguf_name, block)
    return (data if heads is None else interleave_rope_rows(data, heads)).numpy()


ENCODE_BLOCK_BYTES = 64 * 2**20  # float32 bytes of the rows converted and encoded at a time


class _EncodedRows:
    """A matrix whose rows stay in place (every one but the RoPE-permuted q/k), encoded and written a block of rows
    at a time when GGUFWriter.write_tensor_data writes it (it needs only `nbytes` and `tofile`). The export then
    holds one float32 block and its encoding, never a whole encoded copy (an 8B model's f16 embeddings: 1 GiB). The
    same bytes as encoding the whole, since every GGUF type encodes a row on its own."""

    def __init__(self, tensor: torch.Tensor, qtype, nbytes: int):
        self.tensor, self.qtype, self.nbytes = tensor, qtype, nbytes

    def tofile(self, fout) -> None:
        rows, written = self.tensor.shape[0], 0
        step = max(1, ENCODE_BLOCK_BYTES // (4 * self.tensor.shape[1]))
        for start in range(0, rows, step):
            part = _encode(self.tensor[start : start + step].detach().to("cpu", torch.float32).numpy(), self.qtype)
            part.tofile(fout)
            written += part.nbytes
        if written != self.nbytes:  # the index already promised nbytes: a short tensor would shift every later one
            raise HeadlabError(f"encoded {written} bytes where the tensor index says {self.nbytes}")


def _encoded(plan: ExportPlan, gguf_name: str, block: int | None, tensor: torch.Tensor, qtype):
    """What write_tensor_data writes for one tensor: _encode(_converted(...)), or for a matrix whose rows stay in
    place the rows encoded a block at a time as they are written (_EncodedRows)."""
    if tensor.dim() != 2 or _rope_heads(plan, gguf_name, block) is not None:
        return _encode(_converted(plan, gguf_name, block, tensor), qtype)
    return _EncodedRows(tensor, qtype, _stored_layout(tuple(tensor.shape), qtype)[2])


def _file_type(outtype: str) -> int:
    """GGUF's general.file_type code for the output type (llama.cpp's LLAMA_FTYPE; 0 for a type it has none for)."""
    file_type = {"f32": 0, "f16": 1, "bf16": 32}.get(outtype)
    if file_type is None:
        file_type = int(getattr(gguf.LlamaFileType, f"MOSTLY_{outtype.upper()}", 0))
    return file_type


def _stored_layout(shape: tuple[int, ...], qtype) -> tuple[tuple[int, ...], np.dtype, int]:
    """How GGUF stores a tensor of `shape` in `qtype`: its byte shape, numpy dtype and size in bytes."""
    byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype) if qtype.name not in ("F32", "F16") else shape
    itemsize = {"F32": 4, "F16": 2}.get(qtype.name, 1)
    dtype = {"F32": np.float32, "F16": np.float16}.get(qtype.name, np.uint8)
    return byte_shape, np.dtype(dtype), math.prod(byte_shape) * itemsize


def _add_tensor_infos(writer, items: list, types: dict) -> None:
    """The tensor index: each tensor's name, stored (byte) shape, numpy dtype and size, in writing order."""
    for name, _, tensor in items:
        qtype = types[name]
        byte_shape, dtype, nbytes = _stored_layout(tuple(tensor.shape), qtype)
        writer.add_tensor_info(
            name, byte_shape, dtype, nbytes, raw_dtype=None if qtype.name in ("F32", "F16") else qtype
        )


def export_gguf(
    loaded: LoadedModel,
    out: Path,
    *,
    outtype: str = DEFAULT_TYPE,
    overwrite: bool = False,
    progress: bool = True,
    verify=None,
    imatrix=None,
    gptq=None,
    smooth=None,
    smooth_alpha: float | str = DEFAULT_ALPHA,
) -> dict:
    """Write `loaded` as a GGUF file at `out` atomically (a temporary file beside it, renamed at the end; see
    headlab.core.fsio.atomic_file: a second run writing `out` meanwhile is refused, and overwrite replaces only a GGUF
    file headlab wrote, recognised by its `headlab.version` metadata key).

    Tensors stream one at a time (header and tensor index first, then each tensor converted and written), so the
    export holds the model plus one converted tensor. A llama.cpp file type (`check_type`) is first written that way
    in f32 to a second temporary file beside `out` (removed afterwards), which llama.cpp's quantizer reads into the
    first. `verify(path)` (optional) runs on the finished temporary file before it is published; its result goes
    into the returned record. `imatrix` (calibration batches, llama.cpp types only) gives llama.cpp's quantizer an
    importance matrix measured on them (`importance_matrix`). `gptq` (calibration batches; GPTQ_TYPES, or a llama.cpp
    type, whose recipe's matrices in those types are then rounded) rounds every matrix with a calibration input by
    GPTQ instead of to nearest (`gptq_rounding`). `smooth` (calibration batches) rescales every feed-forward's inputs
    exactly so that llama.cpp's 8-bit activation rounding loses less (SmoothQuant with `smooth_alpha`, a number or
    "auto", chosen per input on the file's simulated rounding: headlab.runtimes.smoothing); the importance matrix and
    GPTQ then see the rescaled inputs. Returns what was written.
    """
    out = Path(out)
    outtype = _check_export_args(out, overwrite, outtype, imatrix, gptq, smooth, smooth_alpha)
    plan = plan_export(loaded)
    config = loaded.model.config.get_text_config()
    tokens, notes = _tokenizer_fields(loaded.tokenizer, int(config.vocab_size))
    items = _export_items(loaded, plan, config)
    ftype = llamacpp_ftype(outtype)  # None: headlab writes the type itself
    written = QUANTIZE_FROM if ftype else outtype
    check_free_space(out, *export_bytes(items, outtype, ftype is not None))  # before any tensor is converted
    types, kept_notes = _tensor_types(plan, items, written, outtype)
    notes += kept_notes

    smoothing = None
    if smooth is not None:
        qtypes = {name: qtype.name.lower() for name, qtype in types.items()}
        smoothing = feed_forward_smoothing(loaded, items, smooth, smooth_alpha, progress, qtypes)
    smoothed = None if smoothing is None else smoothing.record()
    # GPTQ's matrices: for headlab's own types known now (moments measured before any writing), for a llama.cpp
    # file type only once its recipe has chosen (after the first quantization), so moments are measured for the
    # matrices it rounds and no others
    rounding = None
    if gptq is not None and ftype is None:
        rounding = gptq_rounding(loaded, items, {name: qtype.name.lower() for name, qtype in types.items()}, gptq,
                                 progress, smoothing)  # fmt: skip

    def write(path: Path, provenance: str | None = None, rounding: GptqRounding | None = None) -> None:
        content = (tokens, items, types, smoothing, rounding)
        _write_file(path, loaded, plan, content, _file_type(written), provenance, progress)

    weights, imatrix_record = (None, None)
    if imatrix is not None:
        weights, imatrix_record = importance_matrix(loaded, items, imatrix, progress, smoothing)
    # atomic_file: one run at a time writes `out` (a lock), a temporary file beside it, renamed into place without
    # replacing what appeared meanwhile, with the umask's permissions; a full disk is one line.
    with atomic_file(out, overwrite=overwrite) as tmp:
        if ftype is None:
            quantization = _write_by_headlab(tmp, write, outtype, smoothed, rounding)
        else:
            recipe_gptq = None
            if gptq is not None:
                recipe_gptq = partial(
                    gptq_rounding, loaded, items, batches=gptq, progress=progress, smoothing=smoothing
                )
            quantization = {"by": "llama.cpp", "ftype": ftype, "from": QUANTIZE_FROM, "nthread": llamacpp.threads(),
                            **llamacpp.versions(), "imatrix": imatrix_record}  # fmt: skip
            if smoothed is not None:
                quantization["smoothing"] = smoothed
            notes += _quantize_by_llamacpp(out, tmp, write, plan, outtype, quantization, weights, recipe_gptq)
        stored, problem = _stored_types(tmp, outtype)
        if quantization is not None:
            quantization["fallback_matrices"] = stored["fallbacks"]
        if problem:
            notes.append(problem)
        record = _record(out, tmp, plan, outtype, stored, quantization, tokens, notes)
        if smoothed is not None:
            record["smoothing"] = smoothed
        if verify is not None:
            record["verification"] = verify(tmp)
    return record


def _tensor_types(plan: ExportPlan, items: list, written: str, outtype: str) -> tuple[dict, list[str]]:
    """Each tensor's GGUF type in the file headlab writes (`written`; f32 for what the plan keeps in f32), and a note
    naming the tensors kept in f32 when the user asked for another type."""
    types = {name: _tensor_type("f32" if plan.kept_f32(name) else written, name, tuple(t.shape))
             for name, _, t in items}  # fmt: skip
    kept = sorted({name.split(".", 2)[-1] for name, _, _ in items if plan.kept_f32(name)})
    notes = []
    if kept and outtype != "f32":
        notes.append(f"{', '.join(kept)} kept in f32 (the latent-norm fold makes them too small for f16 or a block "
                     "scale)")  # fmt: skip
    return types, notes


def _check_export_args(out: Path, overwrite: bool, outtype: str, imatrix, gptq, smooth, smooth_alpha) -> str:
    """export_gguf's argument checks, before any work (one line each): the output's name and place, the type against
    the calibrations asked for, the smoothing alpha; returns the type as written."""
    check_output_name(out)
    if os.path.isdir(out):
        raise HeadlabError(f"out={out} is a directory; export-gguf writes one .gguf file")
    check_out(out, overwrite)  # before the work; atomic_file checks again when it starts writing
    outtype = check_type(outtype, imatrix is not None, gptq is not None)
    if smooth is not None:
        check_alpha(smooth_alpha, outtype)
    return outtype


def _write_by_headlab(tmp: Path, write, outtype: str, smoothed: dict | None, rounding) -> dict | None:
    """headlab writes `tmp` in `outtype` itself (float, or the gguf package's quantizers, GPTQ-rounded with
    `rounding`); returns the quantization record (None for a float type)."""
    quantization = None if outtype in FLOAT_TYPES else {"by": "gguf", "gguf": _package_version("gguf")}
    if quantization is not None and smoothed is not None:
        quantization["smoothing"] = smoothed
    if rounding is not None:
        quantization["gptq"] = rounding.calibration
    words = _calibration_words(quantization) if quantization else ""  # provenance only for calibrated files
    write(tmp, f"headlab (gguf {quantization['gguf']}){words}" if words else None, rounding)
    if rounding is not None:
        quantization["gptq"] = rounding.record()
    return quantization


def _quantize_by_llamacpp(
    out: Path, tmp: Path, write, plan: ExportPlan, outtype: str, quantization: dict, weights, gptq
) -> list[str]:
    """llama.cpp's quantizer writes `tmp` in `outtype` (with headlab's per-tensor type overrides) from an f32 file
    `write` puts beside `out` (removed at the end). With `gptq` (the recipe's {name: type} -> a GptqRounding) the f32
    file is written again with the matrices the recipe puts in legacy blocks GPTQ-rounded, and quantized again. Fills
    `quantization`'s record; returns notes for the user."""
    overrides, notes = _llamacpp_tensor_types(plan, outtype, quantization["imatrix"])
    with scratch_file(out) as source:  # the f32 file, beside `out`: same file system, removed at the end
        write(source, _provenance(quantization))
        llamacpp.quantize(source, tmp, quantization["ftype"], quantization["nthread"], tensor_types=overrides,
                          imatrix=weights)  # fmt: skip
        if gptq is None:
            return notes
        # The recipe's types are known only now: its legacy-block matrices GPTQ-rounded, then quantized again
        chosen = _matrix_types(tmp)
        rounding = gptq(chosen)
        quantization["gptq"] = rounding.calibration
        write(source, _provenance(quantization), rounding)
        llamacpp.quantize(source, tmp, quantization["ftype"], quantization["nthread"], tensor_types=overrides,
                          imatrix=weights)  # fmt: skip
        if _matrix_types(tmp) != chosen:
            raise HeadlabError("llama.cpp's recipe chose other tensor types for the GPTQ-rounded file")
        kept = _written_as_given(source, tmp, list(rounding.errors))
        quantization["gptq"] = {**rounding.record(), "written_as_rounded": kept}
        if kept < len(rounding.errors):
            notes.append(f"llama.cpp rounded {len(rounding.errors) - kept} of the {len(rounding.errors)} "
                         "GPTQ-rounded matrices again (its importance-weighted scale search)")  # fmt: skip
    return notes


def _export_items(loaded: LoadedModel, plan: ExportPlan, config) -> list[tuple]:
    """The (GGUF name, block, tensor) triples the file holds, in order: an attention-free layer's attention tensors
    left out, deepseek2's kv_b split into attn_k_b / attn_v_b, llama3's frequency factors first."""
    items = [
        (gguf_name, block, tensor)
        for gguf_name, block, tensor in _gguf_names(loaded.model).values()
        if not (block in plan.attention_free and gguf_name.split(".")[2].startswith("attn_"))
    ]
    if plan.target.arch == "deepseek2":
        items = _prescale_rope_rows(_split_kv_b(items, config), config)
    if plan.rope_freqs is not None:
        items.insert(0, ("rope_freqs.weight", None, torch.tensor(plan.rope_freqs, dtype=torch.float32)))
    return items


def _write_file(path: Path, loaded: LoadedModel, plan: ExportPlan, content: tuple, file_type, provenance, progress):
    """One GGUF file at `path`: headlab's mark (and `provenance`, which llama.cpp's quantizer copies into its output),
    the hyperparameters, the tokenizer, then the tensors streamed one at a time. content: (tokenizer fields, items,
    GGUF type per tensor name, a Smoothing or None, a GptqRounding or None)."""
    tokens, items, types, smoothing, rounding = content
    writer = gguf.GGUFWriter(path, plan.target.arch)
    writer.add_string(GGUF_MARK, __version__)  # what lets a later --overwrite recognise the file as headlab's
    if provenance:
        writer.add_string(QUANTIZED_BY, provenance)
    _hparams(writer, plan, loaded.model.config.get_text_config(), loaded, file_type)
    _add_tokenizer(writer, tokens)
    _add_tensor_infos(writer, items, types)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, block, tensor in tqdm(items, desc="export-gguf", unit="tensor", disable=not progress):
        tensor = _resident(tensor)
        if smoothing is not None:  # the rescaled tensor is the one GPTQ rounds
            tensor = smoothing(name, tensor)
        if rounding is not None and name in rounding:  # rows permuted later (RoPE interleave): GPTQ rounds rows apart
            tensor = rounding(name, tensor)
        writer.write_tensor_data(_encoded(plan, name, block, tensor, types[name]))
    writer.close()


def _record(
    out: Path, written: Path, plan: ExportPlan, outtype: str, stored: dict, quantization, tokens, notes
) -> dict:
    """What export_gguf returns: the layout llama.cpp will build, the stored tensor types read back from `written`,
    how it was quantized, and the notes."""
    return {
        "out": str(out),
        "architecture": plan.target.arch,
        "model_type": plan.model_type,
        "uniform": plan.uniform,
        "head_count": plan.heads,
        "head_count_kv": plan.kv_heads,
        "attention_free_layers": plan.attention_free,
        "head_dim": plan.head_dim,
        "outtype": outtype,
        "tensor_types": sorted(stored["counts"]),
        "tensor_type_counts": stored["counts"],
        "quantization": quantization,
        "tensors": stored["tensors"],
        "bytes": written.stat().st_size,
        "rope_permuted": plan.target.interleaved_rope,
        "tokenizer_pre": tokens["pre"],
        "chat_template": isinstance(tokens["chat_template"], str),
        "notes": plan.notes + notes,
    }


def _llamacpp_tensor_types(plan: ExportPlan, outtype: str, imatrix_record: dict | None) -> tuple[dict, list[str]]:
    """llama.cpp's tensor-type overrides ({regex: type}) and the notes they need: the plan's f32 matrices
    (`plan.keep_f32`), and, in an importance-only type (IMATRIX_TYPES), which llama.cpp refuses for a matrix without
    an importance entry, those matrices written q8_0."""
    types = {rf"\.{re.escape(name)}$": "F32" for name in plan.keep_f32}
    without = imatrix_record["matrices_without"] if imatrix_record and outtype in IMATRIX_TYPES else []
    if not without:
        return types, []
    types.update({rf"^{re.escape(name)}$": "Q8_0" for name in without})
    return types, [f"{len(without)} matrices whose inputs transformers never forms have no importance entry and are "
                   f"written q8_0 ({', '.join(without[:2])}, ...)"]  # fmt: skip


def importance_matrix(
    loaded: LoadedModel, items: list, batches, progress: bool = True, smoothing: Smoothing | None = None
) -> tuple[dict, dict]:
    """llama.cpp's importance matrix for the matrices in `items`: E[x_j^2] of each one's input over the calibration
    `batches`, for every matrix whose input in llama.cpp's graph is the input of one transformers linear layer
    (`calibrated_modules`). Returns ({GGUF name: float32 [in_features]}, a record: tokens, entries, the matrices
    without one, the calibration text). With a `smoothing`, of the rescaled inputs."""
    modules, without = calibrated_modules(loaded, items)
    weights, tokens = input_mean_squares(loaded, modules, batches, progress=progress)
    if smoothing is not None:
        weights = {name: smoothing.moments(name, torch.from_numpy(value)).numpy() for name, value in weights.items()}
    return weights, {"tokens": tokens, "entries": len(weights), "matrices_without": without, "text": batches.meta}


def calibrated_modules(loaded: LoadedModel, items: list, *, lookup_table: bool = True) -> tuple[dict, list[str]]:
    """({GGUF name: the transformers linear layer whose input that matrix multiplies in llama.cpp's graph}, the other
    matrices): q, k, v, o, gate, up, down, the output head (a tied one under token_embd, whose product llama.cpp runs
    for the output, unless `lookup_table` is False: the table is also read row by row at the input); MLA's q, q_a, q_b
    and kv_a. Rows permuted or split (the RoPE interleave, attn_k_b/attn_v_b) leave columns alone; MLA's attn_k_b and
    attn_v_b multiply per-head queries and attention-weighted latents that transformers never forms, so they have
    none. A token_embd with no output product on it is a lookup table and is in neither list."""
    written = {name: tuple(tensor.shape) for name, _, tensor in items}
    model, modules = loaded.model, {}
    for hf_name, (gguf_name, _, _) in _gguf_names(model).items():
        owner, _, attribute = hf_name.rpartition(".")
        module = model.get_submodule(owner) if owner else None
        if attribute == "weight" and isinstance(module, torch.nn.Linear) and gguf_name in written:
            modules[gguf_name] = module
    head = model.get_output_embeddings()
    tied = "output.weight" not in written  # llama.cpp's output product then reads token_embd
    if tied and lookup_table and isinstance(head, torch.nn.Linear):
        modules["token_embd.weight"] = head
    without = sorted(name for name, shape in written.items()
                     if len(shape) > 1 and name not in modules and name != "token_embd.weight")  # fmt: skip
    return modules, without


def feed_forward_smoothing(loaded: LoadedModel, items: list, batches, alpha, progress: bool = True,
                           qtypes: dict[str, str] | None = None):  # fmt: skip
    """SmoothQuant's scales for every feed-forward in `items` (headlab.runtimes.smoothing.activation_smoothing), the
    activation maxima read at the inputs of the transformers layers behind ffn_gate and ffn_down (`qtypes`: the
    types the tensors are written in, which alpha "auto" scores)."""
    tensors = {name: tensor for name, _, tensor in items}
    modules, _ = calibrated_modules(loaded, items)
    resident = lambda name: _resident(tensors[name])  # noqa: E731
    return activation_smoothing(loaded, modules, items, resident, batches, alpha, progress, qtypes)


def gptq_rounding(
    loaded: LoadedModel, items: list, qtypes: dict[str, str], batches, progress: bool = True, smoothing=None
):
    """A GptqRounding for every matrix written in a GPTQ type (`qtypes`: {name: type}, headlab's or the types a
    llama.cpp recipe chose) whose input is a transformers linear layer's (`calibrated_modules`; not a tied
    token_embd, which is also the input lookup table that GPTQ's output objective does not see), from E[x x^T] over
    the calibration `batches`, measured for those matrices alone. Refuses when those second moments would not fit in
    half the host's available memory."""
    modules, _ = calibrated_modules(loaded, items, lookup_table=False)
    modules = {name: module for name, module in modules.items() if qtypes.get(name) in GPTQ_TYPES}
    needed = 8 * sum(module.in_features**2 for module in modules.values())  # float64 sums, all held in one pass
    available = available_memory("cpu")
    if available is not None and needed > available // 2:
        raise HeadlabError(
            f"GPTQ's input second moments need {human_bytes(needed)} (float64, {len(modules)} matrices) and the host "
            f"has {human_bytes(available)} available; export without --gptq"
        )
    grams, tokens = input_grams(loaded, modules, batches, progress=progress, desc="GPTQ inputs")
    if smoothing is not None:  # of the rescaled inputs (a shared sum is rescaled once per matrix reading it)
        grams = {name: smoothing.moments(name, gram) for name, gram in grams.items()}
    return GptqRounding(grams, qtypes, {"tokens": tokens, "text": batches.meta})


def export_bytes(items: list, outtype: str, by_llamacpp: bool) -> tuple[int, str]:
    """(bytes, how estimated) the export needs on the output's file system: the written numbers at 4 bytes (f32) or
    2 (f16, bf16, and as a bound for gguf's own quantized types); a llama.cpp type also needs its f32 scratch file
    beside the output, 4 bytes a number, while the output (at most 2 bytes a number) is written."""
    numbers = sum(math.prod(tensor.shape) for _, _, tensor in items)
    if by_llamacpp:
        return 6 * numbers, f"{numbers:,} numbers: the f32 file llama.cpp quantizes, plus its {outtype} output"
    size = 4 if outtype == "f32" else 2
    return size * numbers, f"{numbers:,} numbers at {size} bytes"


QUANTIZED_BY = "headlab.quantized_by"  # metadata key: which quantizer wrote the file's quantized tensors


def _provenance(quantization: dict) -> str:
    """The QUANTIZED_BY value: e.g. "llama.cpp Q4_K_M from f32 (llama-cpp-python 0.3.36, ggml 0.25.3, 0c1e570)"."""
    parts = [f"llama-cpp-python {quantization.get('llama_cpp_python')}", f"ggml {quantization.get('ggml')}"]
    if quantization.get("commit"):
        parts.append(f"commit {quantization['commit']}")
    imatrix = quantization.get("imatrix")
    weighted = f", importance matrix of {imatrix['tokens']} calibration tokens" if imatrix else ""
    return (
        f"llama.cpp {quantization['ftype']} from {quantization['from']}{weighted}{_calibration_words(quantization)} "
        f"({', '.join(parts)})"
    )


def _calibration_words(quantization: dict) -> str:
    """The provenance's words for smoothing and GPTQ (", feed-forward inputs smoothed (SmoothQuant, alpha 0.5, N
    calibration tokens), its q8_0 / q5_0 / q4_0 matrices GPTQ-rounded on N calibration tokens": the types GPTQ
    rounds, whichever of them the file holds)."""
    smoothing, gptq = quantization.get("smoothing"), quantization.get("gptq")
    words = ""
    if smoothing:
        words += (f", feed-forward inputs smoothed (SmoothQuant, alpha {smoothing['alpha']}, {smoothing['tokens']} "
                  "calibration tokens)")  # fmt: skip
    if gptq:
        words += f", its {' / '.join(GPTQ_TYPES)} matrices GPTQ-rounded on {gptq['tokens']} calibration tokens"
    return words


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _block(outtype: str) -> int:
    """Elements per block of the type the output type stores its matrices in (llama.cpp's k-quant and i-quant file
    types: QK_K = 256, except IQ4_NL's 32); 1 for the float types."""
    if outtype in FLOAT_TYPES:
        return 1
    if llamacpp_ftype(outtype):
        return 32 if outtype == "iq4_nl" else 256
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[outtype.upper()]][0]


def _matrix_types(path: Path) -> dict[str, str]:
    """{matrix name: its ggml type, lower case} in a GGUF file."""
    return {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1}


def _written_as_given(source: Path, written: Path, names: list[str]) -> int:
    """How many of the matrices `names` the quantized file `written` holds exactly as the f32 file `source` gave them
    (dequantized): GPTQ's rounding survives llama.cpp's quantizer when it lands on the grid it was rounded to."""
    given = {t.name: t for t in gguf.GGUFReader(source).tensors if t.name in names}
    same = 0
    for tensor in gguf.GGUFReader(written).tensors:
        if tensor.name in given:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            same += bool(np.array_equal(values.reshape(-1), np.asarray(given[tensor.name].data).reshape(-1)))
    return same


def _stored_types(path: Path, outtype: str) -> tuple[dict, str | None]:
    """The tensor types the finished file holds (read back with gguf's reader: llama.cpp picks them per tensor), the
    matrices whose rows (ggml's ne0, the input features) do not split into the output type's blocks and what they
    were stored as instead (llama.cpp: a fallback quant type such as q5_0 for q4_k, else f16; headlab's numpy path:
    f16), and a note naming those."""
    reader = gguf.GGUFReader(path)
    counts: dict[str, int] = {}
    fallbacks, rows, matrices = {}, set(), 0
    block = _block(outtype)
    for tensor in reader.tensors:
        name = tensor.tensor_type.name.lower()
        counts[name] = counts.get(name, 0) + 1
        if len(tensor.shape) > 1:
            matrices += 1
            if int(tensor.shape[0]) % block:
                fallbacks[tensor.name] = name
                rows.add(int(tensor.shape[0]))
    summary = {"counts": dict(sorted(counts.items())), "fallbacks": fallbacks, "tensors": len(reader.tensors)}
    if not fallbacks:
        return summary, None
    names = list(fallbacks)
    shown = ", ".join(names[:3]) + (f", ... ({len(names) - 3} more)" if len(names) > 3 else "")
    return summary, (
        f"{len(fallbacks)} of {matrices} matrices have rows of {', '.join(map(str, sorted(rows)))} elements, not a "
        f"multiple of {outtype}'s {block}-element blocks: stored as {', '.join(sorted(set(fallbacks.values())))} "
        f"instead ({shown})"
    )
