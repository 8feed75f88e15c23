"""Saving edited models as checkpoints that vanilla transformers loads, verified by reloading them.

Shared by every command that writes weights (GQA conversion, physical pruning, recovery): save atomically, reload,
compare logits on a fixed probe input, and only then move the directory into place (with the command's record files
beside the weights: `save_with_record`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.utils import logging as hf_logging

from headlab.core import distributed
from headlab.core.arch import adapter_for
from headlab.core.errors import HeadlabError
from headlab.core.fsio import atomic_directory, check_out, write_json
from headlab.core.layout import HEAD_LAYOUT_KEY, WITHOUT_HUB_KERNELS, has_head_layout, load_pruned, model_class
from headlab.core.loading import LoadedModel, input_device, load_model
from headlab.core.reload_stream import should_stream, streamed_reload
from headlab.core.tables import versions

META_FILE = "headlab.json"  # what headlab wrote into a checkpoint directory: the edit and its verification


class CheckpointMismatch(HeadlabError):
    """The reloaded checkpoint computes different logits from the model in memory (nothing was written)."""


@dataclass
class Verification:
    """Result of `verify_reload`: how far the reloaded model's logits are from the in-memory model's; or, for a
    model spread over several devices (no room for a second copy), of `meta_load_check` (names and shapes only)."""

    loader: str  # "transformers.AutoModelForCausalLM.from_pretrained" or "headlab.core.loading.load_model"
    max_abs_diff: float | None = None  # None: checked by a meta-device load, not by logits
    max_abs_logit: float | None = None
    tolerance: float | None = None
    probe_shape: tuple[int, int] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def describe_check(check: dict) -> str:
    """One line for a verification record (Verification.to_dict() or a layer-by-layer conversion's)."""
    if check.get("max_abs_diff") is not None:
        return f"{check['loader']}: max |logit diff| {check['max_abs_diff']:.2e}"
    return f"{check['loader']}: every tensor name and shape fits the config (no second copy loaded)"


def check_checkpoint_out(out: Path, overwrite: bool, source: str | Path | None = None) -> None:
    """Fail before any work when `out` would replace or nest inside the source itself, exists without overwrite, or
    is something overwrite may not replace (fsio.check_replaceable: only a previous headlab output or an empty
    folder)."""
    if source is not None and Path(source).expanduser().exists():
        target, origin = Path(out).expanduser().resolve(), Path(source).expanduser().resolve()
        if target == origin or origin.is_relative_to(target) or target.is_relative_to(origin):
            raise HeadlabError(f"out={out} would overwrite or nest inside the source model {source}; choose another")
    check_out(out, overwrite)


def _special_ids(config) -> set[int]:
    """Token ids a config reserves (pad, bos, image, ...): a probe avoids them, multimodal models reject some."""
    ids = set()
    for cfg in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for name, value in cfg.to_dict().items():
            if (name.endswith("_token_id") or name.endswith("_token_index")) and isinstance(value, int):
                ids.add(value)
            elif name.endswith("_token_id") and isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    return ids


def probe_inputs(model: nn.Module, batch: int = 2, seq_len: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A fixed, seeded batch of ordinary token ids (special ids excluded) with a full attention mask."""
    config = model.config
    vocab = config.get_text_config().vocab_size
    allowed = torch.tensor(sorted(set(range(vocab)) - _special_ids(config)), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(allowed), (batch, seq_len), generator=generator)
    input_ids = allowed[picks]  # [B, T]
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


@torch.no_grad()
def logits_of(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 logits [B, T, V] of `model` on `inputs` (moved to the model's input device), without a cache."""
    device = input_device(model)
    out = model(**{k: v.to(device) for k, v in inputs.items()}, use_cache=False)
    return out.logits.float().cpu()


def default_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance on the logits: reloading stores the same weights, so only kernel noise may differ."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def _auto_class_for(model: nn.Module):
    """The transformers Auto class that maps this model's config to exactly its class (vanilla loading)."""
    # The Auto classes' mappings take about half a second to import: only a reload needs them (start-up time).
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForMaskedLM

    for auto in (AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForImageTextToText):
        try:
            if auto._model_mapping[type(model.config)] is type(model):
                return auto
        except KeyError:
            continue
    return type(model)  # a bare or uncommon head: its own from_pretrained is still vanilla transformers


def reload(path: Path, like: nn.Module) -> tuple[nn.Module, str]:
    """Load `path` the way a user would: the vanilla Auto class, or headlab's loader for non-uniform layouts."""
    parameter = next(like.parameters())
    attn = getattr(like.config, "_attn_implementation", None) or "eager"
    config = json.loads((Path(path) / "config.json").read_text())
    text = config.get("text_config") or {}
    if HEAD_LAYOUT_KEY in config or HEAD_LAYOUT_KEY in text:
        device = "cuda" if parameter.device.type == "cuda" else "cpu"
        dtype = str(parameter.dtype).removeprefix("torch.")
        loaded = load_model(str(path), device=device, dtype=dtype, attn_implementation=attn)
        return loaded.model.to(parameter.device), "headlab.core.loading.load_model"
    auto = _auto_class_for(like)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a mismatch is reported as one line by verify_reload, not as transformers' table
    try:
        model = auto.from_pretrained(str(path), dtype=parameter.dtype, attn_implementation=attn, **WITHOUT_HUB_KERNELS)
    finally:
        hf_logging.set_verbosity(verbosity)
    name = f"transformers.{auto.__name__}.from_pretrained"
    return model.to(parameter.device).eval(), name


def verify_reload(
    path: Path,
    model: nn.Module,
    *,
    inputs: dict[str, torch.Tensor] | None = None,
    tolerance: float | None = None,
    expected: torch.Tensor | None = None,
) -> Verification:
    """Reload `path` and require max |logits_reloaded - logits_model| <= tolerance x max(1, max |logits_model|).

    Raises CheckpointMismatch otherwise. `expected` (logits of `model` on `inputs`) skips recomputing them.
    """
    inputs = inputs if inputs is not None else probe_inputs(model)
    dtype = next(model.parameters()).dtype
    tolerance = default_tolerance(dtype) if tolerance is None else tolerance
    expected = logits_of(model, inputs) if expected is None else expected
    if should_stream(model):  # no second full copy: the reloaded blocks are streamed from disk one at a time
        with streamed_reload(path, model, _auto_class_for(model)) as (reloaded, loader):
            got = logits_of(reloaded, inputs)
    else:
        reloaded, loader = reload(path, model)
        got = logits_of(reloaded, inputs)
        del reloaded
    if got.shape != expected.shape:
        raise CheckpointMismatch(
            f"reloaded {path} gives logits of shape {tuple(got.shape)}, not {tuple(expected.shape)}"
        )
    diff = float((got - expected).abs().max())
    scale = float(expected.abs().max())
    result = Verification(loader, diff, scale, tolerance, tuple(inputs["input_ids"].shape))
    if not diff <= tolerance * max(1.0, scale):  # also catches NaN
        raise CheckpointMismatch(
            f"the checkpoint reloaded with {loader} differs from the model in memory: max |logit diff| {diff:.3g} "
            f"> {tolerance:g} x {max(1.0, scale):.3g}; nothing was written"
        )
    return result


def meta_load_check(path: Path, tolerated: set[str] = frozenset()) -> dict:
    """Load `path` the way a user would (the class its config names, vanilla from_pretrained) onto the meta device:
    transformers checks every tensor name and shape against the config without allocating storage. For checkpoints
    too large to reload beside the model (layer-by-layer conversion, models spread over several devices).
    `tolerated`: stored names transformers may ignore as unexpected (ones the source already held)."""
    # AutoConfig's mapping takes about half a second to import: only this check needs it (start-up time).
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    adapter = adapter_for(config)
    cls = model_class(config, adapter)
    pruned = has_head_layout(config)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # transformers prints its own mismatch table; headlab reports one line
    try:
        if pruned:
            # load_pruned raises on any missing, unexpected or mismatched tensor
            load_pruned(path, config, adapter, device_map="meta")
            return {"loader": "headlab.core.layout.load_pruned(device_map='meta')"}
        _, info = cls.from_pretrained(path, device_map="meta", output_loading_info=True, **WITHOUT_HUB_KERNELS)
    except (OSError, RuntimeError, ValueError) as error:
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise CheckpointMismatch(f"the saved checkpoint does not load: {first}; nothing was written") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    info["unexpected_keys"] = set(info.get("unexpected_keys") or ()) - set(tolerated)
    problems = {k: sorted(v)[:3] for k, v in info.items() if k != "error_msgs" and v}
    if problems:
        raise CheckpointMismatch(f"the saved checkpoint does not fit its config: {problems}; nothing was written")
    return {"loader": f"transformers {cls.__name__}.from_pretrained(device_map='meta')"}


def spans_devices(model: nn.Module) -> bool:
    """True for a model a device map spread over several devices (reloading a second copy would not fit)."""
    return len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1


@contextlib.contextmanager
def saving_on_every_rank(model: nn.Module):
    """transformers writes checkpoint files only on rank 0 of an initialised process group. Under torchrun every
    headlab rank saves its own copy and reads it back (rank 0 into --out, the others into a scratch folder of their
    own: headlab.cli._ranks), so that whatever follows the save runs the same on every rank."""
    if not distributed.active():
        yield
        return
    model.should_save_on_this_rank = lambda is_main_process: is_main_process  # shadows transformers' rank-0 rule
    try:
        yield
    finally:
        del model.should_save_on_this_rank


def save_checkpoint(
    model: nn.Module,
    tokenizer,
    out: Path,
    *,
    overwrite: bool = False,
    meta: dict | None = None,
    verify: bool = True,
    tolerance: float | None = None,
) -> Verification | None:
    """Save model (+ tokenizer, + `headlab.json` with `meta`) to `out` atomically; with verify=True reload the saved
    files first and raise CheckpointMismatch (writing nothing) if their logits differ from the model's. A model a
    device map spread over several devices is checked by `meta_load_check` instead (no room for a second copy)."""
    hf_logging.disable_progress_bar()  # per-shard bars are noise next to headlab's own progress
    out = Path(out)
    check_out(out, overwrite)
    by_logits = verify and not spans_devices(model)
    inputs = probe_inputs(model) if by_logits else None
    expected = logits_of(model, inputs) if by_logits else None
    verification = None
    with atomic_directory(out, overwrite=overwrite) as tmp, saving_on_every_rank(model):
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if by_logits:
            verification = verify_reload(tmp, model, inputs=inputs, tolerance=tolerance, expected=expected)
        elif verify:  # a model filling several devices leaves no room to reload a copy beside it
            verification = Verification(**meta_load_check(tmp))
        record = {
            **(meta or {}),
            "verification": verification.to_dict() if verification else None,
            "versions": versions(),
        }
        write_json(tmp / META_FILE, record)
    return verification


def save_with_record(
    loaded: LoadedModel,
    out: Path,
    meta: dict,
    write_extras: Callable[[Path], None] | None = None,
    *,
    overwrite: bool = False,
) -> dict | None:
    """Save `loaded`'s model and tokenizer to `out` with `headlab.json` (`meta`) and the command's own record files,
    all published by one rename: stage `out` (fsio.atomic_directory), `save_checkpoint` into the staging directory
    (it reloads the files and compares logits first), `write_extras(staging)` adds the record files, then publish.
    Any failure, the reload check's included, leaves nothing at `out`. Returns the verification (as a dict)."""
    with atomic_directory(Path(out), overwrite=overwrite) as staging:
        # save_checkpoint stages its own directory and moves it onto `staging`; the record files join it before the
        # one rename that publishes `out`.
        verification = save_checkpoint(loaded.model, loaded.tokenizer, staging, overwrite=True, meta=meta)
        if write_extras is not None:
            write_extras(staging)
    return verification.to_dict() if verification else None
