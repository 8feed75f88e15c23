"""Layer-wise (local) reconstruction (`--recover local`): tune each edited attention layer so that its output
reproduces the original layer's on calibration windows, one layer at a time, memory bounded by one layer's activations.

Inputs and targets: the edited layer sees the edited model's own hidden states (what it will see at inference, the
earlier layers already reconstructed). Its target is, with targets="original" (default), the original layer's output
on the original model's hidden states, so a layer also absorbs the drift that the edited layers before it left in its
input; with targets="same", the original layer's output on the same (edited) inputs, a pure function match in which
an unchanged layer never moves. docs/recovery.md gives the measurement behind the default.
Error (per layer, over unpadded calibration tokens t, y = the output projection's output):
    e = sum_t ||y_edited(t) - y_target(t)||^2 / sum_t ||y_target(t)||^2
Per layer: (1) a few AdamW passes over the fit windows on the layer's attention parameters (q, k, v, o and per-head
norms: a KV merge or pruning changes the nonlinear part, which has no closed form); (2) the closed-form ridge refit of
the output projection given the new head outputs (headlab.recovery.compensate.ridge_solve, ridge towards the current weights,
alpha chosen on held-out windows). Windows alternate fit (even) / held out (odd), and each stage is kept only if it
lowers e on the held-out windows, so no layer leaves worse than it came on held-out text. Kwon et al. 2022 ("mask
tuning") refit pruned layers by layer-wise least squares in the same spirit. Heads whose output-projection columns are
all zero (mask-pruned or padding heads) stay dead: their outputs are masked while fitting and their columns stay zero.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from headlab.core.arch import AttentionLayer
from headlab.core.errors import HeadlabError
from headlab.core.loading import LoadedModel, check_resident
from headlab.mechanisms.hooks import hooks
from headlab.recovery.compensate import ALPHAS, ridge_solve

TARGETS = ("original", "same")


@dataclass
class LocalSpec:
    """Settings of local reconstruction (recorded in the checkpoint's metadata)."""

    steps: int = 12  # AdamW passes over the fit windows, per layer (0: the closed-form refit only)
    lr: float = 1e-4  # AdamW learning rate of those passes
    targets: str = "original"  # "original": original layer on original inputs; "same": on the edited inputs
    minutes: float | None = None  # optional wall-clock cap for all layers (split evenly over the layers left)
    refit_output: bool = True  # stage 2, the closed-form output-projection refit

    def check(self) -> None:
        if self.steps < 0:
            raise HeadlabError(f"local reconstruction steps must be >= 0, got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise HeadlabError(f"the local reconstruction lr must be a positive number, got {self.lr}")
        if self.targets not in TARGETS:
            raise HeadlabError(f"unknown local targets {self.targets!r}; use one of {', '.join(TARGETS)}")
        if self.minutes is not None and not (0 < self.minutes <= 10_000):
            raise HeadlabError(f"minutes={self.minutes} must be in (0, 10000]")


def check_pair(student: LoadedModel, teacher: LoadedModel) -> None:
    """The student must be derived from the teacher: one vocabulary, the same blocks, hidden size and layer count (and
    the same model type, unless the student's attention was converted to latent attention)."""
    if student.tokenizer is not None and teacher.tokenizer is not None:
        if student.tokenizer.get_vocab() != teacher.tokenizer.get_vocab():
            raise HeadlabError("the student and the teacher use different tokenizers; recovery needs one vocabulary")
    s, t = student.model.config.get_text_config(), teacher.model.config.get_text_config()
    # convert-mla rebuilds a model's attention as latent attention in another model type (deepseek_v3) around the
    # same embeddings, MLPs and norms: such a student is derived from its teacher when the blocks below match.
    converted = student.adapter.latent_kv and not teacher.adapter.latent_kv
    if s.model_type != t.model_type and not converted:
        raise HeadlabError(f"the student is not derived from the teacher: a {s.model_type} and a {t.model_type} model")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "n_embd", "n_layer"):
        a, b = getattr(s, name, None), getattr(t, name, None)
        if a != b:
            raise HeadlabError(
                f"the student is not derived from the teacher: {name} {a} vs {b} (recovery needs the same model "
                "with edited attention)"
            )
    if len(student.layers) != len(teacher.layers) or [x.block for x in student.layers] != [
        x.block for x in teacher.layers
    ]:
        raise HeadlabError("the student is not derived from the teacher: different attention layers")


def dead_heads(loaded: LoadedModel, layer: AttentionLayer) -> list[int]:
    """Heads whose output-projection block is all zero: mask-pruned heads and physical padding heads."""
    o = loaded.adapter.read(layer).o  # [C, H, D]
    return [h for h in range(layer.num_heads) if not bool(o[:, h].abs().sum() > 0)]


def _zeroing(keep: torch.Tensor):
    """A heads_out site hook multiplying the head outputs [B, T, H*D] by `keep` (1 live, 0 dead)."""
    return lambda z: z * keep.to(z.device, z.dtype)


@contextlib.contextmanager
def dead_heads_kept(loaded: LoadedModel, dead_per_layer: list[list[int]] | None = None):
    """While training, dead heads' outputs are zeroed before the output projection, so their (zero) columns get no
    gradient and stay zero: a pruned head is never revived. Yields the number of dead heads; the hooks go on exit.
    dead_per_layer: the dead heads of each layer found earlier (a sharded model's weights cannot be read whole)."""
    site_hooks, count = [], 0
    for index, layer in enumerate(loaded.layers):
        dead = dead_heads(loaded, layer) if dead_per_layer is None else dead_per_layer[index]
        if dead:
            keep = torch.ones(layer.num_heads, layer.head_dim)
            keep[dead] = 0
            site_hooks.append(("heads_out", layer, _zeroing(keep.reshape(-1))))
            count += len(dead)
    with hooks(loaded.adapter, site_hooks):
        yield count


class _Stop(Exception):
    """Raised by a capture hook once it has what it needs, to skip the rest of a forward pass."""


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@dataclass
class _Call:
    """One recorded module call, minus its hidden states (positional first argument or hidden_states=)."""

    args: tuple
    kwargs: dict
    positional: bool

    def run(self, module, hidden):
        if self.positional:
            return module(hidden, *self.args, **self.kwargs)
        return module(*self.args, hidden_states=hidden, **self.kwargs)


def _record(args, kwargs) -> tuple[torch.Tensor, _Call]:
    if args:
        return args[0], _Call(tuple(args[1:]), dict(kwargs), True)
    kwargs = dict(kwargs)
    hidden = kwargs.pop("hidden_states")
    return hidden, _Call((), kwargs, False)


@torch.no_grad()
def block_calls(loaded: LoadedModel, batches) -> tuple[list[torch.Tensor], list[list[_Call]], list[torch.Tensor]]:
    """One forward per batch, recording every block's call (masks, rotary tables: they differ per layer type) and the
    first block's input hidden states; returns (hidden [B, T, C] per batch, calls[block][batch], valid [B, T])."""
    blocks = loaded.adapter.blocks(loaded.model)
    hidden0, calls, valid = [], [[] for _ in blocks], []

    def pre_hook_for(index):
        def hook(module, args, kwargs):
            hidden, call = _record(args, kwargs)
            calls[index].append(call)
            if index == 0:
                hidden0.append(hidden.detach())
            if index == len(blocks) - 1:
                raise _Stop  # the final norm and the LM head are not needed

        return hook

    handles = [b.register_forward_pre_hook(pre_hook_for(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        for input_ids, attention_mask, *_ in batches:
            valid.append(attention_mask.bool())
            try:
                loaded.model(
                    input_ids=input_ids.to(loaded.device),
                    attention_mask=attention_mask.to(loaded.device),
                    use_cache=False,
                )
            except _Stop:
                pass
    finally:
        for handle in handles:
            handle.remove()
    if not hidden0:
        raise HeadlabError("no calibration windows for local reconstruction")
    return hidden0, calls, valid


def attention_output(loaded: LoadedModel, layer: AttentionLayer, call: _Call, hidden: torch.Tensor) -> torch.Tensor:
    """The output projection's output [B, T, C] of one layer on recorded inputs (the projection may sit outside the
    attention module, as in BERT: then it is applied to the module's output)."""
    out_proj = loaded.adapter.out_proj(layer)
    captured = {}
    handle = out_proj.register_forward_hook(lambda module, args, out: captured.__setitem__("y", out))
    try:
        out = call.run(layer.module, hidden)
    finally:
        handle.remove()
    return captured["y"] if "y" in captured else out_proj(_first(out))


@torch.no_grad()
def _attention_inputs(block, module, hidden: list[torch.Tensor], calls: list[_Call]):
    """The attention module's input hidden states and call, per batch, running the block only up to it."""
    inputs, attn_calls = [], []

    def hook(mod, args, kwargs):
        x, call = _record(args, kwargs)
        inputs.append(x.detach())
        attn_calls.append(call)
        raise _Stop

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for x, call in zip(hidden, calls):
            try:
                call.run(block, x)
            except _Stop:
                pass
    finally:
        handle.remove()
    return inputs, attn_calls


@torch.no_grad()
def _propagate(block, hidden: list[torch.Tensor], calls: list[_Call], loaded=None, layer=None):
    """Each batch's hidden states through one block; with `layer`, also the output projection's outputs on the way."""
    outputs, targets = [], []
    handle = None
    if layer is not None:
        handle = loaded.adapter.out_proj(layer).register_forward_hook(
            lambda module, args, out: targets.append(out.detach())
        )
    try:
        for x, call in zip(hidden, calls):
            outputs.append(_first(call.run(block, x)).detach())
    finally:
        if handle is not None:
            handle.remove()
    return outputs, targets


class _LayerFit:
    """The fitting problem of one layer: recorded inputs and calls, targets, fit/held-out token masks."""

    def __init__(self, loaded, layer, inputs, calls, targets, parts):
        self.loaded, self.layer = loaded, layer
        self.inputs, self.calls, self.targets, self.parts = inputs, calls, targets, parts  # parts: [B, T] 0/1/-1
        self.dead = dead_heads(loaded, layer)
        keep = torch.ones(layer.num_heads, layer.head_dim)
        keep[self.dead] = 0
        self.keep = keep.reshape(-1)
        self.norms = [sum(float((y.double() ** 2)[p == part].sum()) for y, p in zip(targets, parts)) for part in (0, 1)]

    def masked(self):
        """A pre-hook on the output projection that zeroes dead heads' outputs (their columns are zero anyway)."""
        return hooks(self.loaded.adapter, [("heads_out", self.layer, _zeroing(self.keep))])

    def output(self, i):
        return attention_output(self.loaded, self.layer, self.calls[i], self.inputs[i])

    def errors(self) -> list[float]:
        """Relative squared error on the fit (0) and held-out (1) tokens."""
        sums = [0.0, 0.0]
        with self.masked(), torch.no_grad():
            for i, (y, p) in enumerate(zip(self.targets, self.parts)):
                err = ((self.output(i).double() - y.double()) ** 2).sum(-1)  # [B, T]
                for part in (0, 1):
                    sums[part] += float(err[p == part].sum())
        return [s / max(n, 1e-300) for s, n in zip(sums, self.norms)]


def _parameters(loaded, layer) -> list[torch.nn.Parameter]:
    seen, params = set(), []
    for module in (layer.module, loaded.adapter.out_proj(layer)):
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _steps(fit: _LayerFit, spec: LocalSpec, deadline: float, held: float) -> tuple[int, float, bool]:
    """Stage 1: AdamW passes over the fit tokens (one step = one pass, gradients summed over the batches); the state
    with the lowest held-out error, the start included, is kept. Returns (passes run, held-out error, whether the
    minutes cap ended the passes early)."""
    params = _parameters(fit.loaded, fit.layer)
    flags = [p.requires_grad for p in params]
    best = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    norm = max(fit.norms[0], 1e-300)
    done, capped = 0, False
    try:
        for p in params:
            p.requires_grad_(True)
        for _ in range(spec.steps):
            if time.perf_counter() > deadline:
                capped = True
                break
            optimizer.zero_grad(set_to_none=True)
            with fit.masked():
                for i, (y, part) in enumerate(zip(fit.targets, fit.parts)):
                    mask = (part == 0).to(y.device)
                    if bool(mask.any()):
                        err = ((fit.output(i).float() - y.float()) ** 2).sum(-1)  # [B, T]
                        (err[mask].sum() / norm).backward()
            optimizer.step()
            done += 1
            error = fit.errors()[1]
            if not math.isfinite(error):
                break
            if error < held:
                held, best = error, [p.detach().clone() for p in params]
    finally:
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, b, flag in zip(params, best, flags):
                p.copy_(b)
                p.requires_grad_(flag)
    return done, held, capped


@torch.no_grad()
def _output_grams(fit: _LayerFit):
    """Per part (fit, held out): Gram [n+1, n+1] of [z, 1], cross [n+1, C] with the target y, and sum ||y||^2 (float64),
    z = the output projection's input (dead heads zeroed)."""
    stats, captured = {}, {}

    def capture(z):  # [B, T, H*D], dead heads zeroed
        captured["z"] = z * fit.keep.to(z.device, z.dtype)
        return captured["z"]

    with hooks(fit.loaded.adapter, [("heads_out", fit.layer, capture)]):
        for i, (y, part) in enumerate(zip(fit.targets, fit.parts)):
            fit.output(i)
            z = captured["z"].double()
            z = torch.cat([z, torch.ones_like(z[..., :1])], -1)  # [B, T, n+1]
            for p in (0, 1):
                rows = (part == p).to(z.device)
                zp, yp = z[rows].cpu(), y.double()[rows.to(y.device)].cpu()  # [N, n+1], [N, C]
                gram, cross, yy = stats.get(p, (0, 0, 0))
                stats[p] = (gram + zp.T @ zp, cross + zp.T @ yp, yy + float((yp**2).sum()))
    return [stats.get(p) for p in (0, 1)]


def _gram_error(theta, stats) -> float:
    gram, cross, yy = stats
    return float((theta * (gram @ theta)).sum() - 2 * (theta * cross).sum() + yy)


@torch.no_grad()
def _refit_output(fit: _LayerFit) -> float | None:
    """Stage 2: the ridge refit of the live output-projection columns (and bias) towards the current weights, alpha
    chosen on the held-out tokens with "no change" as a candidate; returns the alpha used (None: unchanged)."""
    stats = _output_grams(fit)
    if stats[0] is None or stats[1] is None:
        return None
    adapter, layer = fit.loaded.adapter, fit.layer
    w = adapter.read(layer)
    C, n = w.o.shape[0], layer.num_heads * layer.head_dim
    W = w.o.reshape(C, n).double().cpu()
    live = [c for c in range(n) if bool(fit.keep[c] > 0)]
    K = live + ([n] if w.o_bias is not None else [])
    theta0 = torch.cat([W.T, (w.o_bias.double().cpu() if w.o_bias is not None else torch.zeros(C))[None]])[K]
    penalty = torch.ones(len(K), dtype=torch.float64)
    if w.o_bias is not None:
        penalty[-1] = 0.0  # the bias is not shrunk

    def solve(part_stats, alpha):
        gram, cross, _ = part_stats
        return ridge_solve(gram[K][:, K], cross[K], theta0, penalty, alpha, len(live))

    def held_error(theta):
        gram, cross, yy = stats[1]
        return _gram_error(theta, (gram[K][:, K], cross[K], yy))

    best_alpha, best = None, held_error(theta0)
    for alpha in ALPHAS:
        error = held_error(solve(stats[0], alpha))
        if error < best:
            best_alpha, best = alpha, error
    if best_alpha is None:
        return None
    total = tuple(a + b for a, b in zip(stats[0], stats[1]))
    theta = solve(total, best_alpha)
    W_new = W.clone()
    W_new[:, live] = theta[: len(live)].T
    w.o = W_new.reshape(w.o.shape).to(w.o.dtype)
    if w.o_bias is not None:
        w.o_bias = theta[-1].to(w.o_bias.dtype)
    adapter.write(layer, w)
    return best_alpha


def fit_layer(fit: _LayerFit, spec: LocalSpec, deadline: float) -> dict:
    """Both stages on one layer; each is undone if the held-out error did not fall. One row of the record."""
    start = time.perf_counter()
    fit_before, held_before = fit.errors()
    row = {"layer": fit.layer.index, "dead_heads": len(fit.dead), "error_before": held_before}
    row.update(fit_error_before=fit_before, steps=0, stopped_on_time=False, alpha=None, changed=False)
    if not held_before + fit_before > 0:  # the layer already reproduces its target exactly: nothing moves
        return {**row, "error_after": held_before, "fit_error_after": fit_before, "seconds": 0.0}
    original = fit.loaded.adapter.read(fit.layer)
    held = held_before
    if spec.steps:
        row["steps"], held, row["stopped_on_time"] = _steps(fit, spec, deadline, held)
    if spec.refit_output:
        row["alpha"] = _refit_output(fit)
    fit_after, held_after = fit.errors()
    if not held_after <= held_before:  # numerically worse after all: the layer goes back to how it came
        fit.loaded.adapter.write(fit.layer, original)
        fit_after, held_after = fit_before, held_before
    row.update(error_after=held_after, fit_error_after=fit_after, changed=held_after < held_before)
    row["seconds"] = time.perf_counter() - start
    return row


def _parts(valid: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per batch [B, T]: 0 for tokens of even windows (fit), 1 for odd windows (held out), -1 for padding. A single
    window is both fitted and held out (nothing else to hold out)."""
    parts, window = [], 0
    single = sum(v.shape[0] for v in valid) == 1
    for v in valid:
        parity = (torch.arange(window, window + v.shape[0]) % 2)[:, None].expand_as(v)
        part = torch.where(v, parity, torch.full_like(parity, -1))
        parts.append(part)
        window += v.shape[0]
    if single:
        return [torch.where(p >= 0, 0, -1) for p in parts]
    return parts


def reconstruct(
    student: LoadedModel, teacher: LoadedModel, batches, spec: LocalSpec | None = None, *, progress: bool = True
) -> pd.DataFrame:
    """Local reconstruction of every softmax-attention layer of `student` towards `teacher` (in place), on
    calibration `batches`. One row per layer: layer, error_before/after (held-out relative error), fit errors,
    steps, alpha (None: the output refit did not help), changed, seconds."""
    spec = spec or LocalSpec()
    spec.check()
    check_pair(student, teacher)
    check_resident(student, "local reconstruction")
    check_resident(teacher, "local reconstruction")
    s_hidden, s_calls, valid = block_calls(student, batches)
    parts = _parts(valid)
    original = spec.targets == "original"
    t_hidden, t_calls = block_calls(teacher, batches)[:2] if original else (None, None)
    s_layers = {layer.block: layer for layer in student.layers}
    t_layers = {layer.block: layer for layer in teacher.layers}
    s_blocks, t_blocks = student.adapter.blocks(student.model), teacher.adapter.blocks(teacher.model)
    budget = math.inf if spec.minutes is None else spec.minutes * 60
    start, rows = time.perf_counter(), []
    for b in tqdm(range(len(s_blocks)), desc="local reconstruction", disable=not progress, unit="block"):
        if b in s_layers:
            inputs, calls = _attention_inputs(s_blocks[b], s_layers[b].module, s_hidden, s_calls[b])
            if original:
                t_hidden, targets = _propagate(t_blocks[b], t_hidden, t_calls[b], teacher, t_layers[b])
            else:
                with torch.no_grad():
                    targets = [attention_output(teacher, t_layers[b], c, x).detach() for c, x in zip(calls, inputs)]
            device = inputs[0].device
            targets = [y.to(device) for y in targets]
            layers_left = sum(1 for k in s_layers if k >= b)
            deadline = time.perf_counter() + (budget - (time.perf_counter() - start)) / layers_left
            fit = _LayerFit(student, s_layers[b], inputs, calls, targets, [p.to(device) for p in parts])
            rows.append(fit_layer(fit, spec, deadline))
        elif original:
            t_hidden, _ = _propagate(t_blocks[b], t_hidden, t_calls[b])
        s_hidden, _ = _propagate(s_blocks[b], s_hidden, s_calls[b])
    return pd.DataFrame(rows)


def summary(table: pd.DataFrame, spec: LocalSpec, batches_meta: dict | None = None) -> dict:
    """The metadata record of a reconstruction (the per-layer table goes next to it)."""
    return {
        "spec": asdict(spec),
        "layers_changed": int(table["changed"].sum()) if len(table) else 0,
        # layers whose passes the minutes cap cut short (each still kept its best state)
        "layers_stopped_on_time": int(table["stopped_on_time"].sum()) if len(table) else 0,
        "error_before": float(table["error_before"].mean()) if len(table) else 0.0,
        "error_after": float(table["error_after"].mean()) if len(table) else 0.0,
        "seconds": float(table["seconds"].sum()) if len(table) else 0.0,
        "calibration": batches_meta,
    }
