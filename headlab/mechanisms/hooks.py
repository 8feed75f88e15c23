"""The one hook primitive: `hooks(adapter, [(site, layer, fn), ...])` registers forward pre-hooks at named sites the
adapter resolves and always removes them on exit (TransformerLens' `hooks` context manager, on unmodified models).

Sites: "attn_in" (the attention module's input, [B, T, C]) and "heads_out" (the head outputs concatenated head-major
before the output projection, [B, T, H * D]), per attention layer; and the model-level "resid_final" (the residual
stream entering the final norm, [B, T, C]), given the model in the layer's place; `module_hooks` takes modules
directly. `fn(x)` sees the site's tensor; it returns None to leave it alone or a tensor of the same shape to replace
it. Gates, compensation statistics, KV similarity, merge statistics, logit attribution, the GGUF importance matrix,
GPTQ's moments and the smoothing's activation maxima and sampled inputs use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from headlab.core.arch import HOOK_SITES, MODEL_SITES, Adapter, AttentionLayer
from headlab.core.loading import LoadedModel

SITES = HOOK_SITES  # the per-layer names a hook can use (resolved by Adapter.hook_site)

SiteHook = Callable[[torch.Tensor], "torch.Tensor | None"]


def _pre_hook(fn: SiteHook):
    """A with_kwargs forward pre-hook passing the module's first input (positional, or `hidden_states` given by
    keyword, as transformers' decoder layers call attention) to fn and substituting what fn returns."""

    def hook(module, args, kwargs):
        if args:
            replaced = fn(args[0])
            return None if replaced is None else ((replaced, *args[1:]), kwargs)
        replaced = fn(kwargs["hidden_states"])
        return None if replaced is None else (args, {**kwargs, "hidden_states": replaced})

    return hook


@contextlib.contextmanager
def hooks(adapter: Adapter, site_hooks: Iterable[tuple[str, AttentionLayer | nn.Module, SiteHook]]):
    """Register each (site, layer, fn) for the duration of the block (a MODEL_SITES site takes the model in the
    layer's place); every hook is removed in `finally`."""
    resolved = (
        (adapter.model_site(where, site) if site in MODEL_SITES else adapter.hook_site(where, site), fn)
        for site, where, fn in site_hooks
    )
    with module_hooks(resolved):
        yield


@contextlib.contextmanager
def module_hooks(module_hooks: Iterable[tuple[nn.Module, SiteHook]]):
    """The same for modules given directly (any module's first input, e.g. every linear layer's): each (module, fn)
    registered for the duration of the block, every hook removed in `finally`."""
    handles = []
    try:
        for module, fn in module_hooks:
            handles.append(module.register_forward_pre_hook(_pre_hook(fn), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def input_mean_squares(loaded: LoadedModel, modules: dict, batches, *, progress: bool = False, desc: str = "inputs"):
    """({key: E[x_j^2] over the real (unpadded) tokens of `batches`, x the first input of modules[key]} as float64
    tensors [features], and the number of tokens they average): one pass of the model with a pre-hook per module."""
    return _input_moments(loaded, modules, batches, "squares", progress, desc)


def input_abs_max(loaded: LoadedModel, modules: dict, batches, *, progress: bool = False, desc: str = "inputs"):
    """({key: max_t |x_tj| over the real (unpadded) tokens of `batches`, x the first input of modules[key]} as float64
    tensors [features], and the number of tokens): the activation ranges SmoothQuant's scales need (Xiao et al. 2023,
    eq. 4)."""
    return _input_moments(loaded, modules, batches, "abs_max", progress, desc)


def input_rows(loaded: LoadedModel, modules: dict, batches, *, limit: int, every: int = 4, progress: bool = False,
               desc: str = "inputs"):  # fmt: skip
    """({key: the inputs x of modules[key] at every `every`-th real (unpadded) token of each batch, at most `limit`
    rows, as float32 [rows, features]}, and the number of tokens the pass read): samples of the inputs themselves,
    for an error that is not a function of their moments (a rounding of the activations, headlab.runtimes.smoothing)."""
    return _input_moments(loaded, modules, batches, "rows", progress, desc, limit=limit, every=every)


def input_grams(loaded: LoadedModel, modules: dict, batches, *, progress: bool = False, desc: str = "inputs"):
    """({key: E[x x^T] over the real (unpadded) tokens of `batches`, x the first input of modules[key]} as float64
    tensors [features, features], and the number of tokens they average): the second moments GPTQ's objective
    ||X W^T - X Q^T||^2 = tr((W - Q) X^T X (W - Q)^T) needs (Frantar et al. 2023, eq. 1)."""
    return _input_moments(loaded, modules, batches, "gram", progress, desc)


def _input_moments(loaded: LoadedModel, modules: dict, batches, kind: str, progress: bool, desc: str, *,
                   limit: int = 0, every: int = 1):  # fmt: skip
    """One pass of the model with a pre-hook per module summing, in float64 over the real tokens, x_j^2 (kind
    "squares") or x x^T ("gram"), divided by their number at the end, or taking max_t |x_tj| ("abs_max"). Modules
    called in a row on the very same tensor (q, k and v; gate and up) share one sum: the moments are computed and held
    once. Kind "rows" keeps the inputs themselves: every `every`-th real token of a batch, `limit` rows at most."""
    second = kind == "gram"
    sums: dict = {}
    shared: dict = {}  # key -> the key whose sum it shares
    state = {"mask": None, "tokens": 0, "last": None}

    def accumulate(key):
        def add(x):
            last = state["last"]
            if last is not None and last[0] is x and last[1] != key:  # the previous module's input, the same object
                shared[key] = shared.get(last[1], last[1])
                return
            state["last"] = (x, key)
            mask = state["mask"].to(x.device, torch.float64)  # [B, T]
            if kind == "rows":
                held = sums.setdefault(key, [])
                room = limit - sum(len(rows) for rows in held)
                if room > 0:
                    real = x.detach()[state["mask"].to(x.device).bool()][::every][:room]
                    held.append(real.float().cpu())
                return
            x = x.detach().double()
            if kind == "abs_max":  # padding reads as 0, below every real |x|
                moment = (x.abs() * mask[..., None]).reshape(-1, x.shape[-1]).amax(0).cpu()
                sums[key] = torch.maximum(sums[key], moment) if key in sums else moment
                return
            if second:
                rows = x.reshape(-1, x.shape[-1])
                moment = ((rows * mask.reshape(-1, 1)).T @ rows).cpu()
            else:
                moment = torch.einsum("btc,bt->c", x**2, mask).cpu()
            sums[key] = sums[key] + moment if key in sums else moment

        return add

    device = loaded.device  # where the inputs go, also under a device map
    with torch.no_grad(), module_hooks((module, accumulate(key)) for key, module in modules.items()):
        for input_ids, attention_mask, *_ in tqdm(batches, desc=desc, unit="batch", disable=not progress):
            state["mask"], state["last"] = attention_mask, None
            state["tokens"] += int(attention_mask.sum())
            loaded.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    state["last"] = None
    tokens = max(state["tokens"], 1)
    # in place: no second copy of the moments; maxima and rows are not averaged
    if kind == "rows":
        means = {key: torch.cat(held) for key, held in sums.items()}
    else:
        means = sums if kind == "abs_max" else {key: total.div_(tokens) for key, total in sums.items()}
    out = {}
    for key, module in modules.items():  # a module that never ran reads as zeros of its (linear) width
        width = getattr(module, "in_features", 0)
        shape = (0, width) if kind == "rows" else (width, width) if second else (width,)
        empty = torch.zeros(shape, dtype=torch.float32 if kind == "rows" else torch.float64)
        out[key] = means.get(shared.get(key, key), empty)
    return out, state["tokens"]
