"""`headlab convert-mla --streaming`: MLA conversion of a checkpoint larger than memory.

The source runs only for calibration, with its blocks offloaded to disk by a device map (`--max-memory`): one pass
for the per-layer input Grams (each written to a scratch file beside the output as the pass reaches its layer, so
memory holds one), one for the RoPE phases. Then each attention layer is read in with its module
(weights_in_memory), converted by the same per-layer code as the in-memory path (`convert_into`), its latent norms
folded (`fold_block_norms`) and written into the output shards; every other tensor is copied from the source's
files as stored (`headlab.core.streaming`). The tensors equal `convert-mla`'s in memory with the same plan and
calibration windows; the converted model is never held whole, so nothing is measured on it (no perplexity, no
logits comparison): the result is checked structurally by a vanilla meta-device load.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from headlab.core.checkpoint import META_FILE
from headlab.core.errors import HeadlabError
from headlab.core.fsio import atomic_directory, write_json
from headlab.core.loading import LoadedModel, weights_in_memory
from headlab.core.streaming import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardWriter,
    TensorReader,
    copy_side_files,
    read_source_config,
    stream_tensors,
    verify_streamed,
)
from headlab.core.tables import versions
from headlab.kv.grouping import gqa_layers
from headlab.kv.mla import (
    MlaPlan,
    _gram_pass,
    auto_rope_dims,
    convert_into,
    fold_block_norms,
    layer_kept_frequencies,
    mla_config,
    mla_kv_bytes_per_token,
    qk_norm_multipliers,
    rope_magnitudes,
    rope_phases,
)
from headlab.measure.costs import kv_bytes_per_token

ATTENTION = ".self_attn."  # the attention modules' names in llama-style checkpoints, the sources MLA converts


def check_streamable(plan: MlaPlan) -> None:
    """The rope-dim search builds and runs whole candidate models: streaming needs the split given."""
    if plan.rope_choice == "measured":
        choices = ", ".join(f"--rope-dim {c.rope_dim}" for c in auto_rope_dims(plan))
        raise HeadlabError(
            f"--streaming cannot run the rope-dim search (it runs whole candidate models): give the split, e.g. "
            f"{choices}"
        )


def gram_files(loaded: LoadedModel, batches, directory: Path, progress: bool = True) -> dict[int, Path]:
    """input_grams, each layer's Gram [C+1, C+1] float64 kept in a file of `directory` (added to as later batches
    reach the layer) instead of in memory: 32 layers of an 8B model are 4.3 GB. Returns layer index -> file."""
    files: dict[int, Path] = {}

    def add(index: int, gram: torch.Tensor) -> None:
        path = files.setdefault(index, directory / f"gram-{index}.pt")
        total = torch.load(path) + gram if path.is_file() else gram
        torch.save(total, path)

    layers = _gram_pass(loaded, batches, progress, add)
    if len(files) != len(layers) or float(torch.load(files[layers[0].index])[-1, -1]) == 0:
        raise HeadlabError("no calibration tokens to convert to MLA on")
    return files


def gram_bytes(loaded: LoadedModel) -> int:
    """Scratch bytes of gram_files: one float64 [C+1, C+1] Gram per attention layer."""
    hidden = loaded.model.config.get_text_config().hidden_size
    return len(gqa_layers(loaded)) * (hidden + 1) ** 2 * 8


def _target_skeleton(config):
    """The deepseek_v3 model on the meta device, and the tensor names its checkpoint stores (a tied head left out)."""
    # The model class comes from transformers' lazy module: only a conversion builds one (start-up).
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        target = DeepseekV3ForCausalLM(config)
    names = {k for k in target.state_dict() if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    return target, names


def _check_shared(reader: TensorReader, names: set[str], model_type: str) -> None:
    """Every non-attention tensor of the source is one the target stores under the same name (llama-style MLPs,
    norms, embeddings), and the other way round: what _shared_weights checks on a loaded model, on the files."""
    source = {k for k in reader.where if ATTENTION not in k}
    wanted = {k for k in names if ATTENTION not in k}
    if source != wanted:
        raise HeadlabError(
            f"{model_type}'s non-attention weights do not map onto deepseek_v3 (dense SwiGLU MLP): missing "
            f"{sorted(wanted - source)[:3]}, left over {sorted(source - wanted)[:3]}"
        )


class _LayerConverter:
    """One attention layer at a time: the source's weights read in with their module, converted into a materialised
    DeepseekV3Attention, its latent norms folded, its tensors returned under their checkpoint names, then dropped."""

    def __init__(self, loaded: LoadedModel, target, plan: MlaPlan, calibration: tuple, reader: TensorReader, config):
        self.loaded, self.target, self.plan, self.reader = loaded, target, plan, reader
        self.grams, self.phases = calibration  # layer index -> Gram file; per-layer rope phases
        self.magnitude = rope_magnitudes(loaded, config)
        layers = gqa_layers(loaded)
        self.norms = any(m is not None for layer in layers for m in loaded.adapter.qk_norm_modules(layer))
        by_block = {layer.block: layer.index for layer in layers}
        # file key -> attention layer index, for stream_tensors: model.layers.<block>.self_attn.*
        self.owner = {k: by_block[int(k.split(".")[2])] for k in reader.where if ATTENTION in k}
        self.records, self.folds = [], []

    def convert(self, layer) -> dict[str, torch.Tensor]:
        gram = torch.load(self.grams[layer.index])
        attn = self.target.model.layers[layer.block].self_attn
        attn.to_empty(device="cpu").to(self.loaded.dtype)
        with weights_in_memory(layer.module):  # offloaded by the device map: read it in for this layer only
            w = self.loaded.adapter.read(layer)
            multipliers = qk_norm_multipliers(self.loaded, layer, w, gram) if self.norms else None
            self.records.append(convert_into(w, gram, self.plan, attn, phase=self.phases[layer.index],
                                             magnitude=self.magnitude, multipliers=multipliers,
                                             kept=layer_kept_frequencies(self.loaded, self.plan, layer)))  # fmt: skip
        gamma = self.reader.read(f"model.layers.{layer.block}.input_layernorm.weight").to(self.loaded.dtype)
        with torch.no_grad():
            self.folds += fold_block_norms(attn, gamma, layer.block, self.loaded.dtype)
        prefix = f"model.layers.{layer.block}.self_attn."
        tensors = {prefix + k: t.detach().clone() for k, t in attn.state_dict().items()}
        attn.to("meta")  # drop the layer's storage before the next
        return tensors


def convert_mla_streaming(
    loaded: LoadedModel,
    source,
    out,
    plan: MlaPlan,
    batches,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
) -> dict:
    """Convert the safetensors checkpoint `source` to MLA at `plan` (its rope_dim given) into `out` (atomic; the
    source is never touched), one attention layer in memory at a time. `loaded`: the source loaded for calibration,
    its blocks offloaded by a device map or not (plan_mla(..., resident=False)); `batches`: calibration windows.
    Returns the record written as headlab.json."""
    hf_logging.disable_progress_bar()  # headlab shows its own progress
    source, out = Path(source), Path(out)
    check_streamable(plan)
    files, _ = read_source_config(source, out, overwrite, max_shard_bytes)
    reader = TensorReader(source, files)
    config = mla_config(loaded, plan)
    target, names = _target_skeleton(config)
    _check_shared(reader, names, loaded.model.config.model_type)
    record = {"model": loaded.spec, "source": str(source), "target": "deepseek_v3 (MLA)", "streaming": True,
              "plan": plan.to_dict(), "calibration": getattr(batches, "meta", None),
              "kv_bytes_per_token_before": kv_bytes_per_token(loaded),
              "kv_bytes_per_token_after": mla_kv_bytes_per_token(plan, len(gqa_layers(loaded)), loaded.dtype)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=".headlab-grams-", dir=out.expanduser().absolute().parent) as scratch:
        calibration = gram_files(loaded, batches, Path(scratch), progress), rope_phases(loaded, batches, progress)
        converter = _LayerConverter(loaded, target, plan, calibration, reader, config)
        with atomic_directory(out, overwrite=overwrite) as tmp:
            writer = ShardWriter(tmp, max_shard_bytes)
            stream_tensors(reader, converter, gqa_layers(loaded), writer, progress, desc="MLA layers")
            shards = writer.finish()
            # what save_pretrained of the model would write: the class that loads it, the weights' dtype
            config.architectures, config.dtype = ["DeepseekV3ForCausalLM"], loaded.dtype
            config.save_pretrained(tmp)
            copy_side_files(source, tmp)
            record |= {
                "layers": converter.records,
                "latent_norm_fold": {"norms_folded": len(converter.folds), "folds": converter.folds},
                "shards": shards,
                "bytes_written": writer.total_bytes,
                "measured": "nothing on the converted model (never held whole): run `headlab eval` on the output",
                "verification": verify_streamed(tmp, names),
                "versions": versions(),
                "out": str(out),
            }
            write_json(tmp / META_FILE, record)
    return record
