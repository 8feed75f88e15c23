"""Activation recompute (gradient checkpointing) as a context manager: blocks recompute their activations in
backward instead of storing them, with dropout off and every flag restored on exit. Used by importance and uptrain.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from headlab.core import cpu_matmul


def _checkpoint_in_eval(layer, function, *args, **kwargs):
    """torch.utils.checkpoint of one block whose forward (and its recomputation) runs with layer.training False."""

    def run(*inner_args, **inner_kwargs):
        flag = layer.training
        layer.training = False  # the block's own dropout stays off; its submodules are in eval mode already
        try:
            with cpu_matmul.products_of(layer):  # the recomputation runs the raw forward, which no hook sees
                return function(*inner_args, **inner_kwargs)
        finally:
            layer.training = flag

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


def _arm(module, args):
    # transformers checkpoints a block only when block.training (and grad mode); without grad the block runs as is,
    # so it must stay in eval mode then. The checkpointed forward itself runs with the flag cleared.
    module.training = torch.is_grad_enabled()


def checkpointing_supported(model) -> bool:
    """Whether transformers can checkpoint this model's blocks (GradientCheckpointingLayer)."""
    # start-up: transformers.modeling_layers imports its modeling code, which `headlab --help` never needs
    from transformers.modeling_layers import GradientCheckpointingLayer

    return getattr(model, "supports_gradient_checkpointing", False) and any(
        isinstance(m, GradientCheckpointingLayer) for m in model.modules()
    )


@contextlib.contextmanager
def activation_checkpointing(model, enabled: bool = True):
    """Activation checkpointing of every transformers block, dropout off; yields whether it applies.

    transformers' GradientCheckpointingLayer recomputes a block in backward only when block.gradient_checkpointing,
    block.training and grad mode hold. The model stays in eval mode (no dropout anywhere): a pre-hook sets only the
    block's own training flag, and the checkpointed forward runs with it cleared. Every flag, the checkpoint
    function and the eval/train state are restored on exit, including a checkpointing state the model had before.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer  # start-up: as in checkpointing_supported

    if not enabled or not getattr(model, "supports_gradient_checkpointing", False):
        yield False
        return
    flagged = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    before = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func")) for m in flagged]
    training = [(m, m.training) for m in model.modules()]
    had_input_hook = hasattr(model, "_require_grads_hook")
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5 name; the old is deprecated
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hooks = []
    # No KV cache: a recomputed block would append its keys and values to it a second time.
    configs = {id(c): c for c in (model.config, model.config.get_text_config()) if hasattr(c, "use_cache")}
    caching = [(c, c.use_cache) for c in configs.values()]
    try:
        for config, _ in caching:
            config.use_cache = False
        model.eval()
        blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
        for block in blocks:
            block._gradient_checkpointing_func = functools.partial(_checkpoint_in_eval, block)
            hooks.append(block.register_forward_pre_hook(_arm))
        yield bool(blocks)
    finally:
        for hook in hooks:
            hook.remove()
        for module, flag, func in before:
            module.gradient_checkpointing = flag
            if func is None:
                module.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                module._gradient_checkpointing_func = func
        if not had_input_hook and hasattr(model, "_require_grads_hook"):
            model.disable_input_require_grads()
        for module, flag in training:
            module.training = flag
        for config, flag in caching:
            config.use_cache = flag
