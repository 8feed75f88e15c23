"""Random-weight checkpoints of real model shapes (Llama-3.1-8B, Qwen3-8B, ...), written tensor by tensor into
safetensors shards, so that building an 8B-shaped checkpoint holds one shard in memory, never the model: what the
scale benchmarks run headlab's commands on (docs/scaling.md). Never used by CI, whose models are tiny.

The config is the published one (layers can be cut for the time-linearity measurements: 8, 16, 32 layers); the
weights are N(0, std^2), norms 1; the tokenizer is the embedded model's (its ids lie within every shape's vocabulary),
so text commands run. Quality numbers on these checkpoints mean nothing; memory and time do.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from headlab.core.errors import HeadlabError
from headlab.core.fsio import atomic_directory
from headlab.core.loading import embedded_checkpoint

# Published configurations (config.json of meta-llama/Llama-3.1-8B, -70B, -405B and Qwen/Qwen3-8B), the fields that
# set shapes and RoPE; anything else takes transformers' defaults. The Llama-3.1 family shares 8 KV heads of 128, the
# 128,256-token vocabulary, untied embeddings and llama3 RoPE.
_LLAMA_3_1 = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], num_key_value_heads=8, head_dim=128, vocab_size=128256,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip
SHAPES = {
    "llama-3.1-8b": dict(_LLAMA_3_1, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    # the cost model's larger points (docs/scaling.md)
    "llama-3.1-70b": dict(_LLAMA_3_1, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
    "llama-3.1-405b": dict(_LLAMA_3_1, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                           num_attention_heads=128),
    "qwen3-8b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}  # fmt: skip
SHARD_BYTES = 2 * 2**30  # safetensors shard size: the most the writer holds at once
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def shape_config(shape: str | dict, *, layers: int | None = None, **overrides):
    """The transformers config of `shape` (a name in SHAPES or a dict of config fields with `model_type`), with
    `layers` decoder layers when given and any field overridden (tiny sizes for tests)."""
    from transformers import AutoConfig  # start-up: transformers' config classes load with a command, not at import

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise HeadlabError(f"unknown shape {shape!r}; use one of {', '.join(SHAPES)} or a dict of config fields")
        shape = SHAPES[shape]
    fields = {**shape, **overrides}
    if layers is not None:
        if layers < 1:
            raise HeadlabError(f"layers={layers} must be at least 1")
        fields["num_hidden_layers"] = layers
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def _parameter_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """(state-dict name, shape) of every parameter the model class declares, in its order, from a model built on
    the meta device (no memory)."""
    from transformers import AutoModelForCausalLM  # start-up: see shape_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, tuple(p.shape)) for name, p in model.state_dict().items()]


def write_random_checkpoint(
    shape: str | dict,
    out,
    *,
    layers: int | None = None,
    dtype: str = "bfloat16",
    std: float = 0.02,
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    tokenizer: bool = True,
    overwrite: bool = False,
    **overrides,
) -> dict:
    """Write a checkpoint of `shape` with random weights to `out` (atomically): config.json, safetensors shards of
    at most `shard_bytes` each with model.safetensors.index.json, and the embedded tokenizer. Weights: N(0, std^2)
    from a generator seeded per tensor (seed, name), so a tensor is the same whichever shard size; norm weights 1.
    Returns {out, parameters, bytes, shards}."""
    from safetensors.torch import save_file  # start-up: see shape_config

    if dtype not in DTYPES:
        raise HeadlabError(f"dtype={dtype!r}; use one of {', '.join(DTYPES)}")
    config = shape_config(shape, layers=layers, **overrides)
    config.dtype = dtype
    names = _parameter_shapes(config)
    torch_dtype = DTYPES[dtype]
    itemsize = torch.tensor([], dtype=torch_dtype).element_size()
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shp in names:  # shards by bytes, in the model's order
        nbytes = itemsize * int(torch.Size(shp).numel())
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shp))
        size += nbytes
    weight_map, total, parameters = {}, 0, 0
    out = Path(out)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        config.save_pretrained(tmp)
        for index, group in enumerate(groups, 1):
            file = f"model-{index:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
            shard = {name: _random(name, shp, torch_dtype, std, seed) for name, shp in group}
            save_file(shard, tmp / file, metadata={"format": "pt"})
            for name, tensor in shard.items():
                weight_map[name] = file
                total += tensor.numel() * itemsize
                parameters += tensor.numel()
            del shard  # one shard in memory at a time
        if len(groups) > 1:
            index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
        if tokenizer:
            _write_tokenizer(tmp)
        record = {"shape": shape if isinstance(shape, str) else "custom", "layers": config.num_hidden_layers,
                  "dtype": dtype, "std": std, "seed": seed, "parameters": parameters, "bytes": total,
                  "shards": len(groups), "weights": "random N(0, std^2), norms 1: shapes for memory and time only"}  # fmt: skip
        (tmp / "headlab_shape.json").write_text(json.dumps(record, indent=2))
    return {"out": str(out), **record}


def _random(name: str, shape: tuple[int, ...], dtype: torch.dtype, std: float, seed: int) -> torch.Tensor:
    """One tensor: ones for norm weights (1-D `*norm*` names), else N(0, std^2), from a generator seeded by (seed,
    name) so the values do not depend on the shard a tensor falls in."""
    if len(shape) == 1 and "norm" in name:
        return torch.ones(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(hash_seed(seed, name))
    return (torch.randn(shape, generator=generator) * std).to(dtype)


def hash_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, name) (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def _write_tokenizer(directory: Path) -> None:
    """The embedded model's tokenizer files beside the weights (its ids fit every shape's vocabulary)."""
    source = embedded_checkpoint()
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "added_tokens")):
            (directory / path.name).write_bytes(path.read_bytes())
