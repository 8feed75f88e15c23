"""Reloading a saved checkpoint beside the model in memory without holding a second full copy: the decoder blocks
of the reloaded copy stay on disk and are streamed in one block at a time during its forward pass (accelerate's
disk offload), so a logits comparison costs the embeddings, the head and one block instead of a whole model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from pathlib import Path

from torch import nn

from headlab.core.arch import Adapter, adapter_for
from headlab.core.errors import HeadlabError
from headlab.core.layout import HEAD_LAYOUT_KEY, WITHOUT_HUB_KERNELS, load_pruned

# Below this many parameter bytes a second full copy is cheap and the plain reload is kept (it is also faster).
STREAM_ABOVE_BYTES = 64 * 2**20


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def should_stream(model: nn.Module) -> bool:
    """Stream the reload for CPU models larger than STREAM_ABOVE_BYTES (GPU and device-mapped models keep their
    own paths in checkpoint.py)."""
    parameter = next(model.parameters())
    return parameter.device.type == "cpu" and model_bytes(model) > STREAM_ABOVE_BYTES


def streamed_device_map(like: nn.Module) -> dict[str, str]:
    """A device map for a copy of `like`: every transformer block on "disk", everything else on "cpu"."""
    try:
        adapter = adapter_for(like)
    except HeadlabError:  # a model headlab writes but has no adapter for (a deepseek_v3 MLA conversion): its "layers"
        adapter = Adapter(model_types=())
    blocks = adapter.blocks(like)
    prefix = next(name for name, module in like.named_modules() if module is blocks)
    device_map = {}
    for name, _ in [*like.named_parameters(remove_duplicate=False), *like.named_buffers(remove_duplicate=False)]:
        if name.startswith(prefix + "."):
            index = name[len(prefix) + 1 :].split(".", 1)[0]
            device_map[f"{prefix}.{index}"] = "disk"
        else:
            device_map[name.rsplit(".", 1)[0] if "." in name else ""] = "cpu"
    return device_map


# accelerate logs this when a device map offloads blocks; for headlab's own verification copy the offload is the
# intent, and the line (printed by logging's last-resort handler) reads to users as if their model were broken.
OFFLOAD_NOTICE = "Some parameters are on the meta device"
OFFLOAD_LOGGER = "accelerate.big_modeling"


def _not_offload_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(OFFLOAD_NOTICE)


@contextlib.contextmanager
def offload_notice_dropped():
    """Drop accelerate's offload notice, and only it, while the block runs; the logger is restored on exit."""
    logger = logging.getLogger(OFFLOAD_LOGGER)
    logger.addFilter(_not_offload_notice)
    try:
        yield
    finally:
        logger.removeFilter(_not_offload_notice)


@contextlib.contextmanager
def streamed_reload(path: Path, like: nn.Module, auto_class):
    """Yield (model, loader name): `path` loaded the way a user would (`auto_class`.from_pretrained, or headlab's
    loader for per-layer layouts) with its blocks offloaded to a temporary folder; removed on exit."""
    from transformers import AutoConfig  # start-up: transformers loads its config registry on first use (about 0.5 s)

    parameter = next(like.parameters())
    attn = getattr(like.config, "_attn_implementation", None) or "eager"
    raw = json.loads((Path(path) / "config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="headlab-reload-") as offload:
        kwargs = dict(
            dtype=parameter.dtype,
            attn_implementation=attn,
            device_map=streamed_device_map(like),
            offload_folder=offload,
        )
        with offload_notice_dropped():
            if HEAD_LAYOUT_KEY in raw or HEAD_LAYOUT_KEY in (raw.get("text_config") or {}):
                config = AutoConfig.from_pretrained(path)
                model = load_pruned(str(path), config, adapter_for(config), **kwargs)
                loader = "headlab load_pruned, blocks streamed from disk"
            else:
                model = auto_class.from_pretrained(str(path), **WITHOUT_HUB_KERNELS, **kwargs)
                loader = f"transformers.{auto_class.__name__}.from_pretrained, blocks streamed from disk"
        try:
            yield model.eval(), loader
        finally:
            del model
