"""Quantized KV caches for evaluation (`--kv-cache` of eval, longeval and speed): transformers' QuantizedCache with
its fp8, optimum-quanto and HQQ backends, built fresh per batch, and the bytes such a cache really holds.

What each backend stores per layer (transformers 5 `cache_utils`, defaults kept: group size 64, residual 128, axis 0;
the `-kivi` specs take KIVI's axes, `kivi_axes`, and layout, `KiviQuantoLayer`):

- fp8 (`Fp8QuantizedLayer`): keys and values as float8_e4m3fn with one float32 scale per tensor, amax / 448, set
  by the first update (the prefill, or the first chunk) and frozen; later values beyond it saturate at +-448 x scale.
  Every state, including the newest, is read back dequantized; no full-precision residual.
- quanto, hqq (`QuantizedLayer`, KIVI-style): the first update is quantized whole; later tokens wait in a
  full-precision residual until it would reach 128 tokens, then everything (old quantized states dequantized, the
  residual, the new tokens) is quantized again. Integers of `nbits` bits, packed in uint8 (HQQ 3-bit: int32), with a
  scale and a zero point (quanto: shift) per group of 64 numbers.
"""

from __future__ import annotations

import importlib.util

import torch
from transformers import DynamicCache
from transformers.cache_utils import QuantizedCache, QuantoQuantizedLayer

from headlab.core.errors import HeadlabError
from headlab.mechanisms.choices import KV_CACHE_INSTALL, KV_CACHES


def _installed(module: str) -> bool:
    """Whether `module` imports (tests replace this to simulate a missing backend package)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package ("optimum") is missing
        return False


def check_kv_cache(spec: str) -> str:
    """`spec` if it names a cache of KV_CACHES whose backend package is installed; else one line saying which spec
    exists or what to install."""
    if spec not in KV_CACHES:
        raise HeadlabError(f"unknown --kv-cache {spec!r}; use one of {', '.join(KV_CACHES)}")
    module = KV_CACHES[spec][2]
    if module is not None and not _installed(module):
        package = "optimum-quanto" if module == "optimum.quanto" else module
        raise HeadlabError(f"--kv-cache {spec} needs the {package} package: {KV_CACHE_INSTALL}")
    return spec


# quanto's group axis: 0 groups q_group_size consecutive numbers of one token (per token), -1 groups one channel
# over q_group_size consecutive tokens (per channel; optimum.quanto.tensor.grouped.group).
PER_TOKEN, PER_CHANNEL = 0, -1


def kivi_axes(pure_keys: tuple[bool, bool]) -> dict[str, int]:
    """quanto's axis_key / axis_value under KIVI's grouping (Liu et al. 2024: keys per channel, values per token):
    per channel for a cache slot that holds keys alone (`pure_keys`, the adapter's cache_pure_keys: a GQA cache's
    "keys"; MLA's rotary key, which transformers' deepseek_v3 stores as "values"), per token for the others (values,
    and MLA's latent, which serves as key and value)."""
    key_slot, value_slot = (PER_CHANNEL if pure else PER_TOKEN for pure in pure_keys)
    return {"axis_key": key_slot, "axis_value": value_slot}


class KiviQuantoLayer(QuantoQuantizedLayer):
    """KIVI's cache layout (Liu et al. 2024) on quanto's quantizer: tokens are quantized in whole groups of
    q_group_size, once, when the full-precision residual reaches residual_length, and appended to the quantized
    chunks; the tokens of a group not yet full stay in the residual. A per-channel group (axis -1) then always spans
    q_group_size tokens of one sequence and one head, whatever the length; transformers' QuantizedLayer quantizes
    the first update whole and later requantizes everything, which per channel fails unless batch x heads x tokens
    divides by the group. A prefill attends to its own states unquantized, as there."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.cumulative_length += key_states.shape[-2]
        if not self.is_initialized or self._quantized_keys is None:
            self.lazy_initialization(key_states, value_states)
            self._quantized_keys, self._quantized_values = [], []
            returned = key_states, value_states
        else:
            returned = tuple(
                torch.cat([*(self._dequantize(q) for q in chunks), residual, new], dim=-2)
                for chunks, residual, new in (
                    (self._quantized_keys, self.keys, key_states),
                    (self._quantized_values, self.values, value_states),
                )
            )
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        if self.keys.shape[-2] >= self.residual_length:
            whole = self.keys.shape[-2] // self.q_group_size * self.q_group_size
            self._quantized_keys.append(self._quantize(self.keys[..., :whole, :].contiguous(), axis=self.axis_key))
            self._quantized_values.append(
                self._quantize(self.values[..., :whole, :].contiguous(), axis=self.axis_value)
            )
            self.keys, self.values = self.keys[..., whole:, :], self.values[..., whole:, :]
        return returned

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise HeadlabError("a -kivi KV cache keeps quantized chunks in place; beam search cannot reorder them")


def new_kv_cache(config, spec: str, pure_keys: tuple[bool, bool] = (True, False)):
    """An empty transformers cache for the model `config`: DynamicCache for "full", else QuantizedCache(backend,
    nbits) with transformers' defaults (q_group_size 64, residual_length 128, axis 0; fp8 takes none of them), or
    KIVI's axes for a "kivi" spec (kivi_axes of `pure_keys`, the adapter's cache_pure_keys)."""
    backend, nbits, _, grouping = KV_CACHES[check_kv_cache(spec)]
    if backend is None:
        return DynamicCache(config=config)
    options = {} if backend == "fp8" else {"nbits": nbits}  # fp8 is per-tensor and refuses the group-wise options
    try:
        cache = QuantizedCache(backend=backend, config=config, **options)
    except ValueError as error:  # sliding-window or linear-attention layers: it takes full attention only
        raise HeadlabError(f"--kv-cache {spec}: {str(error).splitlines()[0]}") from None
    if grouping == "kivi":
        cache.layers = [KiviQuantoLayer(nbits=nbits, **kivi_axes(pure_keys)) for _ in cache.layers]
    return cache


def storage_bytes(stored) -> int:
    """Bytes of what a cache layer stores: a plain tensor's numel x element size; a tensor subclass (quanto's
    WeightQBitsTensor, its PackedTensor) by the inner tensors it flattens to (`__tensor_flatten__`: packed data,
    scales, shifts), never its dequantized shape; tuples, lists and dicts (HQQ's (packed, meta), fp8's (data, scale))
    by their tensors."""
    if isinstance(stored, torch.Tensor):
        if type(stored) is not torch.Tensor and hasattr(stored, "__tensor_flatten__"):
            names, _ = stored.__tensor_flatten__()
            return sum(storage_bytes(getattr(stored, name)) for name in names)
        return stored.numel() * stored.element_size()
    if isinstance(stored, (tuple, list)):
        return sum(storage_bytes(item) for item in stored)
    if isinstance(stored, dict):
        return sum(storage_bytes(item) for item in stored.values())
    return 0


def quantized_cache_bytes(cache) -> int:
    """Bytes a transformers cache holds now: per layer its full-precision keys and values (DynamicCache's states, a
    quantized layer's residual) plus the quantized states as stored (`storage_bytes` of `_quantized_keys` and
    `_quantized_values`: packed integers or fp8 with their scales and zero points)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += storage_bytes(getattr(layer, name, None))
    return total
