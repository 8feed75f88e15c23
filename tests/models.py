"""Tiny random models of every supported architecture, built offline from configs (float32, eval mode, seeded).

The fixture module: test modules import the specs to parametrize, `from models import ALL_TYPES, tiny_model`.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMaskedLM,
)

_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
)
_HYBRID = dict(
    _LLAMA,
    layer_types=["linear_attention", "full_attention"],
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
_ENCODER = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64
)

_GEMMA3_TEXT = dict(_LLAMA, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
# Vision towers as small as their configs allow; the tests feed text only.
_SIGLIP = dict(
    model_type="siglip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)
_QWEN3_5_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
_TOKENS = dict(bos_token_id=1, eos_token_id=2)


def _vlm(model_type: str, text: dict, vision: dict, **tokens) -> tuple[str, str, dict]:
    """An image-text wrapper spec: the text config as `{model_type}_text`, the vision tower, image token id 5 and the
    family's other special-token ids (`tokens`, kept below the ids tiny_inputs draws)."""
    config = dict(text_config=dict(text, model_type=f"{model_type}_text"), vision_config=vision, image_token_id=5)
    return model_type, "vlm", {**config, **tokens}


# name -> (model_type, kind, config kwargs); kind is "causal", "masked" (encoder) or "vlm" (image-text wrapper whose
# text part is text_config, where overrides go). Names are model types, plus "_mha" variants of GQA families.
SPECS: dict[str, tuple[str, str, dict]] = {
    "llama": ("llama", "causal", _LLAMA),
    "llama_mha": ("llama", "causal", dict(_LLAMA, num_key_value_heads=4)),
    "mistral": ("mistral", "causal", dict(_LLAMA, sliding_window=4)),
    "qwen2": ("qwen2", "causal", _LLAMA),
    "qwen3": ("qwen3", "causal", _LLAMA),
    "qwen3_mha": ("qwen3", "causal", dict(_LLAMA, num_key_value_heads=4)),
    "qwen3_next": (
        "qwen3_next",
        "causal",
        dict(
            _HYBRID,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ),
    "qwen3_5_text": ("qwen3_5_text", "causal", _HYBRID),
    "qwen3_5": _vlm(
        "qwen3_5", _HYBRID, _QWEN3_5_VISION, video_token_id=6, vision_start_token_id=7, vision_end_token_id=8
    ),
    "gemma3_text": ("gemma3_text", "causal", _GEMMA3_TEXT),
    "gemma3": _vlm("gemma3", _GEMMA3_TEXT, _SIGLIP, mm_tokens_per_image=4, boi_token_id=6, eoi_token_id=7),
    "olmo2": ("olmo2", "causal", _LLAMA),
    "phi3": ("phi3", "causal", dict(_LLAMA, pad_token_id=0)),
    "phi3_mha": ("phi3", "causal", dict(_LLAMA, num_key_value_heads=4, pad_token_id=0)),
    "gpt2": ("gpt2", "causal", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128, **_TOKENS)),
    "gpt_neox": ("gpt_neox", "causal", dict(_ENCODER, vocab_size=128, rotary_pct=0.5, **_TOKENS)),
    "opt": (
        "opt",
        "causal",
        dict(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=64,
            vocab_size=128,
            **_TOKENS,
        ),
    ),
    "bert": ("bert", "masked", dict(_ENCODER, vocab_size=128)),
    "roberta": ("roberta", "masked", dict(_ENCODER, vocab_size=128, pad_token_id=1, max_position_embeddings=66)),
}

ALL_TYPES = list(SPECS)
ENCODER_TYPES = [n for n, (_, kind, _) in SPECS.items() if kind == "masked"]
CAUSAL_TYPES = [n for n in ALL_TYPES if n not in ENCODER_TYPES]
VLM_TYPES = [n for n, (_, kind, _) in SPECS.items() if kind == "vlm"]
HYBRID_TYPES = ["qwen3_next", "qwen3_5_text", "qwen3_5"]  # block 0 is linear attention, block 1 softmax
GATED_TYPES = HYBRID_TYPES


def _text_kwargs(name: str) -> dict:
    _, kind, kwargs = SPECS[name]
    return kwargs["text_config"] if kind == "vlm" else kwargs


# Query heads share KV heads (H=4, G=2) in these; every other spec is MHA (G=H=4).
GQA_TYPES = [n for n in ALL_TYPES if _text_kwargs(n).get("num_key_value_heads", 4) < 4]
MHA_TYPES = [n for n in ALL_TYPES if n not in GQA_TYPES]
# Expected layout per spec: (blocks with softmax heads, H, G, D).
LAYOUTS = {n: ([1] if n in HYBRID_TYPES else [0, 1], 4, 2 if n in GQA_TYPES else 4, 16) for n in ALL_TYPES}
_AUTO = {"causal": AutoModelForCausalLM, "masked": AutoModelForMaskedLM, "vlm": AutoModelForImageTextToText}

# Multi-head latent attention (deepseek_v3) in the form headlab's MLA conversion writes: a dense MLP in every layer
# (first_k_dense_replace = layers), no query LoRA, num_key_value_heads = heads. Kept out of SPECS (and ALL_TYPES):
# KV-head conversion and merging do not apply to MLA, so tests/test_mla_model.py covers these specs itself.
# H = 4, kv_lora_rank R = 12, qk_nope 16 + qk_rope 8 = 24 query/key dims per head, v_head_dim 16.
_DEEPSEEK = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=12,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=2,
    n_routed_experts=4,
    num_mtp_layers=0,
    rope_interleave=True,
    vocab_size=128,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
)
MLA_SPECS: dict[str, tuple[str, str, dict]] = {
    "deepseek_v3": ("deepseek_v3", "causal", _DEEPSEEK),
    "deepseek_v3_qlora": ("deepseek_v3", "causal", dict(_DEEPSEEK, q_lora_rank=24)),  # q_a -> RMSNorm -> q_b
    "deepseek_v3_vdim": ("deepseek_v3", "causal", dict(_DEEPSEEK, qk_nope_head_dim=8, v_head_dim=12)),  # nope != v
    # The latent RMSNorm replaced by an identity, as recovery trains converted models (tiny_model swaps it in).
    "deepseek_v3_nonorm": ("deepseek_v3", "causal", _DEEPSEEK),
}
MLA_TYPES = list(MLA_SPECS)
_IDENTITY_LATENT_NORM = {"deepseek_v3_nonorm"}

# Scaled RoPE shaped like real configs, scaled down (head_dim 64/128 -> 16; the frequencies at 16 dims still span
# every regime of the scaling). Kept out of SPECS: the MLA conversion tests (tests/test_mla.py) cover them.
# Llama-3.2-1B/3B: 4 query heads per KV head, tied embeddings, llama3 scaling (factor 32, low/high 1/4, 8192).
# At dim 16 and theta 5e5 the wavelengths are 6.3, 32, 162, 826 (kept), 4.2e3 (smoothed), 2.1e4... (divided by 32).
_LLAMA3_2 = dict(
    _LLAMA,
    hidden_size=128,
    num_attention_heads=8,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)
# Qwen2.5 with its documented long-context yarn block (factor 4 over 32,768 positions, theta 1e6, q/k/v biases): at
# dim 16 the ramp runs over frequency indices 2..5 of 8.
_YARN = dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768)
ROPE_SCALED_SPECS: dict[str, tuple[str, str, dict]] = {
    "llama3_2": ("llama", "causal", _LLAMA3_2),
    "qwen2_yarn": ("qwen2", "causal", dict(_LLAMA, max_position_embeddings=131072, rope_parameters=_YARN)),
    "llama_yarn": ("llama", "causal", dict(_LLAMA, max_position_embeddings=131072, rope_parameters=_YARN)),
    # Linear position interpolation (Gemma 3's global layers from 4B up: factor 8).
    "llama_linear": (
        "llama",
        "causal",
        dict(_LLAMA, rope_parameters=dict(rope_type="linear", rope_theta=1e6, factor=8.0)),
    ),
}
ROPE_SCALED_TYPES = list(ROPE_SCALED_SPECS)


def _spec(name: str) -> tuple[str, str, dict]:
    for specs in (SPECS, MLA_SPECS, ROPE_SCALED_SPECS):
        if name in specs:
            return specs[name]
    raise KeyError(name)


def tiny_config(name: str, **overrides):
    """The spec's config; overrides go to the text config of multimodal wrappers."""
    model_type, kind, kwargs = _spec(name)
    if kind == "vlm":
        kwargs = dict(kwargs, text_config={**kwargs["text_config"], **overrides})
        return AutoConfig.for_model(model_type, **kwargs)
    return AutoConfig.for_model(model_type, **{**kwargs, **overrides})


def tiny_model(name: str, *, base: bool = False, attn_implementation: str = "eager", seed: int = 0, **overrides):
    """A tiny random model for spec `name` (LM-head model, or the bare base model with base=True).

    Vectors (biases, norm weights) start constant under the usual init, which would hide a bias or norm mapped to
    the wrong head; they get noise of std 0.05 here.
    """
    config = tiny_config(name, **overrides)
    auto = AutoModel if base else _AUTO[_spec(name)[1]]
    torch.manual_seed(seed)
    model = auto.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.05 * torch.randn_like(param))
    if name in _IDENTITY_LATENT_NORM:
        for layer in model.model.layers:
            layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    return model.eval()


def tiny_inputs(name: str, batch: int = 2, seq: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random token ids (above the ids specs use as pad/special/image tokens) and a full attention mask."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(10, 128, (batch, seq), generator=generator)  # [B, T]
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
