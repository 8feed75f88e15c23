"""Post-norm blocks (OLMo 2) in deepseek_v3's pre-norm blocks: the nearest pre-norm form, which the MLA conversion
writes, and what it costs, measured in the source's own modules.

deepseek_v3 computes h = x + Attn(N1(x)), out = h + MLP(N2(h)); OLMo 2 computes h = x + P1(Attn(x)),
out = h + P2(MLP(h)). A norm after a sublayer has no place in the target, and a sublayer that reads the raw residual
stream gets a norm forced on it. The nearest pre-norm form (1) replaces each post-norm P by its calibration constant,
P(y) ~ (g / r) y with r = sqrt(E[mean(y^2)] + eps), the stand-in of the q/k-norm fold
(headlab.kv.mla.qk_norm_multipliers), folded into o_proj's and down_proj's rows; and (2) gives each raw sublayer
input the target's norm N(x) = c x / sqrt(mean(x^2) + eps) with gain c = sqrt(E[mean(x^2)]), which keeps the input
at its calibration scale. What is lost is each token's own RMS. E runs over the calibration tokens (padding
excluded)"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from headlab.core.loading import LoadedModel
from headlab.mechanisms.hooks import input_mean_squares, module_hooks

DEFAULT_EPS = 1e-6  # a norm module that names no eps (none of transformers' RMSNorms)


def norm_eps(module: nn.Module) -> float:
    """The eps an RMS norm module adds to mean(y^2) (transformers names it variance_epsilon or eps)."""
    return float(getattr(module, "variance_epsilon", getattr(module, "eps", DEFAULT_EPS)))


@contextlib.contextmanager
def constant_norms(pairs):
    """Run with each norm module's forward replaced by y * m: (module, m) pairs, m broadcast against y's last dims."""
    patched = []
    try:
        for module, m in pairs:

            def scaled(y, m=m):
                return y * m.to(device=y.device, dtype=y.dtype)

            module.forward = scaled
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward


def post_norm_sites(loaded: LoadedModel) -> tuple[list[tuple], list[tuple]]:
    """Per block, (attention-output norm, MLP-output norm) and (attention, MLP) where the block feeds them the raw
    residual stream, from the adapter's `post_norms` and `raw_sublayers`; empty lists for pre-norm families."""
    adapter = loaded.adapter
    blocks = list(adapter.blocks(loaded.model))
    return tuple([tuple(block.get_submodule(name) for name in names) for block in blocks] if names else []
                 for names in (adapter.post_norms, adapter.raw_sublayers))  # fmt: skip


@dataclass
class PreNormForm:
    """A post-norm source's nearest pre-norm form (the module docstring), per block: `outputs` (attention, MLP)
    multipliers [C] standing in for the post-norms, g / sqrt(E[mean(y^2)] + eps); `gains` (attention, MLP) the
    constant c = sqrt(E[mean(x^2)]) of the norm put before each raw sublayer input, None where the block has its own
    pre-norms; `eps` that norm's eps (the target's)."""

    outputs: list[tuple[torch.Tensor, torch.Tensor]]
    gains: list[tuple[float, float]] | None
    eps: float

    @classmethod
    def measure(cls, loaded: LoadedModel, batches, eps: float) -> PreNormForm | None:
        """The constants from `batches`, or None for a pre-norm source."""
        norms, raw = post_norm_sites(loaded)
        if not norms and not raw:
            return None
        flat = dict(enumerate(m for pair in norms + raw for m in pair))
        squares = iter(float(s.mean()) for s in input_mean_squares(loaded, flat, batches)[0].values())  # E[mean x^2]
        offset = loaded.adapter.norm_offset
        outputs = [tuple((n.weight.detach().double().cpu() + offset) / (next(squares) + norm_eps(n)) ** 0.5
                         for n in pair) for pair in norms]  # fmt: skip
        gains = [tuple(next(squares) ** 0.5 for _ in pair) for pair in raw] or None
        return cls(outputs, gains, eps)

    @contextlib.contextmanager
    def applied(self, loaded: LoadedModel):
        """Run the source in this form: its post-norms constant, a norm of gain c before each raw sublayer input."""
        norms, raw = post_norm_sites(loaded)
        # The attention-output constant scales the output projection's result (the norm itself becomes the
        # identity), where the conversion folds it: attention outputs then compare like for like with the MLA's.
        one = torch.ones(1)
        pairs = [(attn, one) for attn, _ in norms] + [(mlp, m) for (_, mlp), (_, m) in zip(norms, self.outputs)]
        outs = [(loaded.adapter.out_proj(layer), self.outputs[layer.block][0]) for layer in loaded.layers]

        def renormed(c):
            def fn(x):
                return x * (c / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())

            return fn

        inputs = [(m, renormed(c)) for block, cs in zip(raw, self.gains or []) for m, c in zip(block, cs)]
        handles = []
        try:
            for module, m in outs:
                handles.append(module.register_forward_hook(
                    lambda _m, _args, out, m=m: out * m.to(device=out.device, dtype=out.dtype)))  # fmt: skip
            with constant_norms(pairs), module_hooks(inputs):
                yield
        finally:
            for handle in handles:
                handle.remove()
