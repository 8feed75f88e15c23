"""Per-head direct logit attribution (DLA) and activation patching on single prompts.

- DLA (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits"; TransformerLens' apply_ln_to_stack):
  with the final norm's scale s(x) frozen at its value on the whole final residual x, each head's output through its
  output-projection block, c_{l,h} = W_O^{l,h} z_{l,h}, reaches the target's logit as
  DLA_{l,h} = u_t . (g * P(c_{l,h})) / s(x), u_t the target's unembedding row, g the norm's gain, P centring
  (LayerNorm) or the identity (RMSNorm). The rest of x (embeddings, MLPs, output-projection biases, linear-attention
  blocks) gives rest = u_t . (g * P(x - sum c_{l,h})) / s(x) + u_t . b_norm, so sum_{l,h} DLA_{l,h} + rest + b_U[t]
  is the pre-soft-cap logit exactly (up to rounding).
- Activation patching (Meng et al. 2022, causal tracing; Wang et al. 2022, path patching's per-head form): run the
  corrupted prompt with one head's output (its D slice of the output projection's input, every position) taken from
  the clean run; recovered = (m_patched - m_corrupted) / (m_clean - m_corrupted) with the logit difference
  m = logit(correct) - logit(incorrect) at the last position.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.errors import HeadlabError
from headlab.core.tables import head_name
from headlab.mechanisms.hooks import hooks

POSITIONS = ("last", "all")
PATCH_BATCH = 32  # patched copies of the corrupted prompt per forward pass
NORM_CONVENTION = (
    "the final norm's scale s(x) = sqrt(mean(P(x)^2) + eps) is frozen at its value on the whole final residual x and "
    "every component c goes through g * P(c) / s(x) (P: centring for LayerNorm, identity for RMSNorm; g: the norm's "
    "weight as applied, 1 + weight for Gemma-style norms); the norm's bias goes to rest (TransformerLens "
    "apply_ln_to_stack)"
)
SOFTCAP_CONVENTION = (
    "contributions add up to the logit before final logit soft-capping (cap * tanh(z / cap)), which is not linear; "
    "meta 'model_logit' is the model's output after it"
)


def _check_model(loaded) -> None:
    if loaded.tokenizer is None:
        raise HeadlabError("the model has no tokenizer: attribution reads text")
    # Both refuse encoders and models without a final norm (post-LN) in one line, before any forward pass.
    loaded.adapter.final_norm(loaded.model)
    loaded.adapter.unembedding(loaded.model)


def _encode(loaded, text, name: str) -> list[int]:
    """The text's token ids as the tokenizer writes them by default (special tokens such as BOS included)."""
    if not isinstance(text, str) or not text.strip():
        raise HeadlabError(f"{name} is empty: give a text to attribute")
    ids = list(loaded.tokenizer(text)["input_ids"])
    if not ids:
        raise HeadlabError(f"{name}={text[:40]!r} has no tokens")
    limit = loaded.max_positions
    if limit is not None and len(ids) > limit:
        raise HeadlabError(f"{name} is {len(ids)} tokens, more than the model's {limit} positions")
    return ids


def token_id(loaded, token, name: str = "target") -> int:
    """The id of one token given as text (exactly as the tokenizer writes it, a leading space included) or as an id;
    text that is not exactly one known token is refused in one line."""
    vocab = loaded.adapter.unembedding(loaded.model)[0].shape[0]
    if isinstance(token, int) and not isinstance(token, bool):
        if not 0 <= token < vocab:
            raise HeadlabError(f"{name}={token} is not a token id of this model (0 .. {vocab - 1})")
        return token
    if not isinstance(token, str) or token == "":
        raise HeadlabError(f"{name} must be one token (text or id), got {token!r}")
    tokenizer = loaded.tokenizer
    ids = list(tokenizer(token, add_special_tokens=False)["input_ids"])
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None and unknown in ids:
        raise HeadlabError(f"{name}={token!r}: the tokenizer does not know it (it becomes {tokenizer.unk_token!r})")
    if len(ids) != 1:
        pieces = [tokenizer.decode([i]) for i in ids]
        raise HeadlabError(f"{name}={token!r} is {len(ids)} tokens {pieces}, not one")
    if ids[0] >= vocab:
        raise HeadlabError(f"{name}={token!r} is token {ids[0]}, outside the model's {vocab} logits")
    return ids[0]


def _piece(loaded, token: int) -> str:
    return loaded.tokenizer.decode([token])


def _forward(loaded, input_ids: torch.Tensor, site_hooks, *, last_only: bool = False) -> torch.Tensor:
    """Logits of one forward pass under the given hooks ([B, T, V], or [B, 1, V] with last_only where the model's
    forward can keep only the last position's logits)."""
    kwargs = {}
    if last_only and "logits_to_keep" in inspect.signature(loaded.model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    ids = input_ids.to(loaded.device)
    with torch.no_grad(), hooks(loaded.adapter, site_hooks):
        return loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits


def _capture(loaded, input_ids: torch.Tensor, final: bool = True):
    """(logits [1, T, V], per-layer head outputs [T, H*D], final residual [T, C] or None) of one run."""
    layers = loaded.layers
    heads: list[torch.Tensor | None] = [None] * len(layers)
    resid: list[torch.Tensor] = []

    def keep(index: int):
        def hook(x):
            heads[index] = x[0].detach()

        return hook

    site_hooks = [("heads_out", layer, keep(i)) for i, layer in enumerate(layers)]
    if final:
        site_hooks.append(("resid_final", loaded.model, lambda x: resid.append(x[0].detach())))
    logits = _forward(loaded, input_ids, site_hooks)
    return logits, heads, (resid[-1] if resid else None)


def _heads_frame(layers, values: dict[str, list], repeat: int = 1) -> pd.DataFrame:
    """`layer, head, kv_head, name` for every head, `repeat` times (position-major), then the value columns."""
    rows = [
        (layer.index, h, layer.kv_head_of(h), head_name(layer.index, h))
        for layer in layers
        for h in range(layer.num_heads)
    ]
    frame = pd.DataFrame(rows * repeat, columns=["layer", "head", "kv_head", "name"])
    for column, value in values.items():
        frame[column] = value
    return frame


def direct_logit_attribution(loaded, text: str, *, target=None, positions: str = "last") -> pd.DataFrame:
    """Each head's direct contribution to a target logit: DLA_{l,h}(i) = u_t . (g * P(W_O^{l,h} z_{l,h}(i))) / s(x_i)
    (Elhage et al. 2021; the final norm's scale frozen as TransformerLens' apply_ln_to_stack).

    target None: the text's own next tokens, at the second-to-last position (predicting the text's last token) or,
    with positions="all", at every position that has a next token; a target (one token, text or id): that token at
    the last position, or at every position. Returns the tidy table `layer, head, kv_head, name, position, token,
    target, contribution` (token: the input token at `position`); `attrs["meta"]` holds per position the logit, the
    rest, the lm_head bias, the frozen scale and the model's own logit, and the sum check:
    sum_heads contribution + rest + lm_head bias = logit (before soft-capping).
    """
    if positions not in POSITIONS:
        raise HeadlabError(f"positions={positions!r}; use one of {', '.join(POSITIONS)}")
    _check_model(loaded)
    ids = _encode(loaded, text, "text")
    where, targets = _positions_and_targets(loaded, ids, target, positions)
    adapter, model, layers = loaded.adapter, loaded.model, loaded.layers
    logits, heads, resid = _capture(loaded, torch.tensor([ids]))
    norm = adapter.final_norm(model)
    unembed, unembed_bias = adapter.unembedding(model)
    f64 = dict(dtype=torch.float64, device="cpu")  # a few vectors per position: exact enough, on any device
    at = torch.tensor(where)
    tgt = torch.tensor(targets)
    x = resid[at.to(resid.device)].to(**f64)  # [P, C]
    u = unembed[tgt.to(unembed.device)].to(**f64)  # [P, C]
    gain = norm.gain.to(**f64)

    def centre(v: torch.Tensor) -> torch.Tensor:
        return v - v.mean(-1, keepdim=True) if norm.centred else v

    scale = (centre(x).pow(2).mean(-1) + norm.eps).sqrt()  # [P]: s(x_i), frozen
    direction = centre(gain * u) / scale[:, None]  # [P, C]: u . (g * P(c)) / s = (P(g * u) / s) . c, P symmetric
    contributions, rest_vector = [], x.clone()
    for layer, z in zip(layers, heads):
        o = adapter.read(layer).o.to(**f64)  # [C, H, D]
        z = z[at.to(z.device)].to(**f64).unflatten(-1, (layer.num_heads, layer.head_dim))  # [P, H, D]
        # the direction read back through each head's block first: [P, H, D], never a [P, C, H, D] product
        contributions.append((z * torch.einsum("pc,chd->phd", direction, o)).sum(-1))  # [P, H]
        rest_vector -= torch.einsum("phd,chd->pc", z, o)  # the head vectors c_{l,h}, summed
    per_head = torch.cat(contributions, dim=1)  # [P, sum_l H_l], (layer, head) order
    norm_bias = (u * norm.bias.to(**f64)).sum(-1) if norm.bias is not None else torch.zeros(len(where), **f64)
    rest = (direction * rest_vector).sum(-1) + norm_bias  # [P]
    lm_bias = (
        unembed_bias[tgt.to(unembed_bias.device)].to(**f64) if unembed_bias is not None else torch.zeros_like(rest)
    )
    with torch.no_grad():  # the model's own pre-soft-cap logit: its norm module, then the (folded) unembedding
        normed = norm.module(resid[at.to(resid.device)].unsqueeze(0))[0]
        own = (normed.to(**f64) * u).sum(-1) + lm_bias
    output = logits[0, at.to(logits.device)].gather(-1, tgt.to(logits.device)[:, None])[:, 0].to(**f64)
    total = per_head.sum(1) + rest + lm_bias
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    table = _heads_frame(
        layers,
        {
            "position": [p for p in where for _ in range(per_head.shape[1])],
            "token": [_piece(loaded, ids[p]) for p in where for _ in range(per_head.shape[1])],
            "target": [_piece(loaded, t) for t in targets for _ in range(per_head.shape[1])],
            "contribution": per_head.reshape(-1).tolist(),
        },
        repeat=len(where),
    )
    records = [
        {
            "position": p,
            "token": _piece(loaded, ids[p]),
            "target": _piece(loaded, t),
            "target_id": t,
            "logit": float(own[k]),
            "heads_total": float(per_head[k].sum()),
            "rest": float(rest[k]),
            "lm_head_bias": float(lm_bias[k]),
            "frozen_scale": float(scale[k]),
            "model_logit": float(output[k]),
        }
        for k, (p, t) in enumerate(zip(where, targets))
    ]
    sum_check = {
        "identity": "sum_heads contribution + rest + lm_head_bias = logit (pre-soft-cap, from the model's own norm "
        "and unembedding)",
        "max_abs_error": float((total - own).abs().max()),
        "max_abs_logit": float(own.abs().max()),
    }
    table.attrs["meta"] = {
        **loaded.describe(),
        "text": text,
        "tokens": len(ids),
        "positions": positions,
        "target_given": target is not None,
        "per_position": records,
        **_attribution_conventions(loaded, norm, softcap),
        "sum_check": sum_check,
        "heads": int(per_head.shape[1]),
        "blocks": {layer.index: layer.block for layer in layers},
    }
    return table


def _positions_and_targets(loaded, ids: list[int], target, positions: str) -> tuple[list[int], list[int]]:
    """The positions read and the token each one's logit is taken for: without a target, the text's own next tokens
    (the second-to-last position, or every position with a next token); with one, that token at the last position or
    at every position."""
    if target is None:
        if len(ids) < 2:
            raise HeadlabError("text is one token: its next token is unknown; give a target token")
        where = list(range(len(ids) - 1)) if positions == "all" else [len(ids) - 2]
        return where, [ids[i + 1] for i in where]
    fixed = token_id(loaded, target)
    where = list(range(len(ids))) if positions == "all" else [len(ids) - 1]
    return where, [fixed] * len(where)


def _attribution_conventions(loaded, norm, softcap) -> dict:
    """The meta entries that say how the attribution reads the model: the final norm frozen, soft-capping, and what
    the rest term holds."""
    return {
        "norm": {
            "module": type(norm.module).__name__,
            "kind": "LayerNorm (centred)" if norm.centred else "RMSNorm",
            "eps": norm.eps,
            "gain": "1 + weight" if loaded.adapter.norm_offset else "weight",
            "bias_in_rest": norm.bias is not None,
            "convention": NORM_CONVENTION,
        },
        "final_logit_softcapping": softcap,
        "softcap_convention": SOFTCAP_CONVENTION,
        "rest_holds": "embeddings, MLPs, output-projection biases, non-softmax (linear-attention) blocks, the final "
        "norm's bias",
    }


@dataclass
class PatchingSetup:
    """The two runs activation patching compares: token ids [1, T], the answers (correct, incorrect ids), the clean
    run's head outputs per attention layer ([T, H*D]) and the logit difference of each run at the last position."""

    clean_ids: torch.Tensor
    corrupted_ids: torch.Tensor
    answers: tuple[int, int]
    clean_heads: list[torch.Tensor]
    clean_metric: float
    corrupted_metric: float


def _metric(logits: torch.Tensor, answers: tuple[int, int]) -> torch.Tensor:
    """logit(correct) - logit(incorrect) at the last position, per row: [B]."""
    last = logits[:, -1].double()
    return last[:, answers[0]] - last[:, answers[1]]


def patching_setup(loaded, clean: str, corrupted: str, *, target=None, answer_tokens=None) -> PatchingSetup:
    """Run both prompts once. answer_tokens (correct, incorrect) as text or ids; else the correct answer is `target`
    or the clean run's top token, and the incorrect one the corrupted run's top token other than it."""
    _check_model(loaded)
    clean_ids, corrupted_ids = _encode(loaded, clean, "clean"), _encode(loaded, corrupted, "corrupted")
    if len(clean_ids) != len(corrupted_ids):
        raise HeadlabError(
            f"clean and corrupted prompts are {len(clean_ids)} and {len(corrupted_ids)} tokens: patching needs "
            "equal lengths"
        )
    if answer_tokens is not None:
        answer_tokens = list(answer_tokens)
        if len(answer_tokens) != 2:
            raise HeadlabError(f"answer_tokens needs two tokens (correct, incorrect), got {len(answer_tokens)}")
    clean_t, corrupted_t = torch.tensor([clean_ids]), torch.tensor([corrupted_ids])
    clean_logits, clean_heads, _ = _capture(loaded, clean_t, final=False)
    corrupted_logits = _forward(loaded, corrupted_t, [], last_only=True)
    if answer_tokens is not None:
        answers = (
            token_id(loaded, answer_tokens[0], "correct answer"),
            token_id(loaded, answer_tokens[1], "incorrect answer"),
        )
    else:
        correct = token_id(loaded, target) if target is not None else int(clean_logits[0, -1].argmax())
        ranked = corrupted_logits[0, -1].argsort(descending=True)[:2].tolist()
        answers = (correct, ranked[1] if ranked[0] == correct else ranked[0])
    if answers[0] == answers[1]:
        raise HeadlabError(f"the correct and incorrect answers are the same token {_piece(loaded, answers[0])!r}")
    clean_metric = float(_metric(clean_logits, answers)[0])
    corrupted_metric = float(_metric(corrupted_logits, answers)[0])
    if clean_metric == corrupted_metric:
        raise HeadlabError(
            f"clean and corrupted runs give the same logit difference ({clean_metric:.4g}): nothing to recover"
        )
    return PatchingSetup(
        clean_t, corrupted_t, answers, [h.detach() for h in clean_heads], clean_metric, corrupted_metric
    )


def patched_metrics(loaded, setup: PatchingSetup, patches, *, batch_size: int = PATCH_BATCH, progress: bool = False):
    """The corrupted run's logit difference with each patch applied: a patch is a list of (layer, head) pairs whose
    outputs (every position) come from the clean run. Patches go through the model `batch_size` at a time, one
    batch row each. Returns one float per patch."""
    if batch_size < 1:
        raise HeadlabError(f"batch_size={batch_size} must be at least 1")
    layers = loaded.layers
    for patch in patches:
        for layer, head in patch:
            if not (0 <= layer < len(layers) and 0 <= head < layers[layer].num_heads):
                raise HeadlabError(f"no head {head} in attention layer {layer}")
    values: list[float] = []
    steps = range(0, len(patches), batch_size)
    for start in tqdm(steps, desc="activation patching", disable=not progress, unit="batch"):
        chunk = patches[start : start + batch_size]
        site_hooks = []
        for layer in layers:
            width = layer.num_heads * layer.head_dim
            mask = torch.zeros(len(chunk), 1, width, dtype=torch.bool)  # [k, 1, H*D]: which slices come from clean
            for row, patch in enumerate(chunk):
                for index, head in patch:
                    if index == layer.index:
                        mask[row, 0, head * layer.head_dim : (head + 1) * layer.head_dim] = True
            if mask.any():
                clean = setup.clean_heads[layer.index]
                site_hooks.append(("heads_out", layer, _patch_hook(mask.to(clean.device), clean)))
        ids = setup.corrupted_ids.expand(len(chunk), -1)
        values.extend(_metric(_forward(loaded, ids, site_hooks, last_only=True), setup.answers).tolist())
    return values


def _patch_hook(mask: torch.Tensor, clean: torch.Tensor):
    def hook(x):
        return torch.where(mask, clean.to(x.dtype), x)  # [k, T, H*D]: the masked slices from the clean run

    return hook


def activation_patching(
    loaded,
    clean: str,
    corrupted: str,
    *,
    target=None,
    answer_tokens=None,
    batch_size: int = PATCH_BATCH,
    progress: bool = False,
) -> pd.DataFrame:
    """Per-head activation patching (Meng et al. 2022; Wang et al. 2022): each head's output at every position from
    the clean run into the corrupted run; recovered = (m_patched - m_corrupted) / (m_clean - m_corrupted), m the
    logit difference logit(correct) - logit(incorrect) at the last position (answers: see patching_setup).

    Returns the tidy table `layer, head, kv_head, name, patched, recovered` (patched: m with that head patched);
    `attrs["meta"]` holds both runs' metrics, the answers and the tokens."""
    setup = patching_setup(loaded, clean, corrupted, target=target, answer_tokens=answer_tokens)
    layers = loaded.layers
    patches = [[(layer.index, head)] for layer in layers for head in range(layer.num_heads)]
    patched = patched_metrics(loaded, setup, patches, batch_size=batch_size, progress=progress)
    span = setup.clean_metric - setup.corrupted_metric
    table = _heads_frame(
        layers, {"patched": patched, "recovered": [(m - setup.corrupted_metric) / span for m in patched]}
    )
    correct, incorrect = setup.answers
    table.attrs["meta"] = {
        **loaded.describe(),
        "clean": clean,
        "corrupted": corrupted,
        "tokens": int(setup.clean_ids.shape[1]),
        "differing_positions": (setup.clean_ids[0] != setup.corrupted_ids[0]).nonzero()[:, 0].tolist(),
        "answers": {
            "correct": _piece(loaded, correct),
            "correct_id": correct,
            "incorrect": _piece(loaded, incorrect),
            "incorrect_id": incorrect,
            "given": answer_tokens is not None or target is not None,
        },
        "metric": "logit(correct) - logit(incorrect) at the last position, on the model's output logits",
        "clean_metric": setup.clean_metric,
        "corrupted_metric": setup.corrupted_metric,
        "recovered": "(patched - corrupted) / (clean - corrupted)",
        "patched_site": "heads_out: the head's D slice of the output projection's input (after the output gate of "
        "gated-attention families), every position",
        "batch_size": batch_size,
        "heads": len(patches),
        "finite": all(math.isfinite(m) for m in patched),
        "blocks": {layer.index: layer.block for layer in layers},
    }
    return table
