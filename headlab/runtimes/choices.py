"""The runtimes `headlab speed` and the tensor type `export-gguf` choose among, torch-free so the CLI builds its
options without importing torch."""

RUNTIMES = ("transformers", "llama.cpp")
DEFAULT_TYPE = "f16"  # GGUF tensor type of `headlab export-gguf --outtype` (headlab.runtimes.gguf_export)
# `export-gguf --outtype` names that llama.cpp's own quantizer writes (llama_model_quantize, its per-tensor recipe):
# llama-quantize's names, lower-cased, -> the LLAMA_FTYPE_MOSTLY_* suffix. Only file types it quantizes without an
# importance matrix (IQ1_*, IQ2_*, IQ3_XXS, IQ3_XS and Q2_K_S refuse without one: IMATRIX_TYPES below) and whose
# tensor types a model is trained for (no ternary TQ*, no MoE-only MXFP4_MOE). q3_k, q4_k and q5_k are
# llama-quantize's aliases of the _m mixes. Float types and the legacy/Q8_0 types the gguf package quantizes in numpy
# are not here: headlab writes those.
LLAMACPP_TYPES = {
    "q2_k": "Q2_K",
    "q3_k_s": "Q3_K_S",
    "q3_k_m": "Q3_K_M",
    "q3_k_l": "Q3_K_L",
    "q4_k_s": "Q4_K_S",
    "q4_k_m": "Q4_K_M",
    "q5_k_s": "Q5_K_S",
    "q5_k_m": "Q5_K_M",
    "q6_k": "Q6_K",
    "iq3_s": "IQ3_S",
    "iq3_m": "IQ3_M",
    "iq4_nl": "IQ4_NL",
    "iq4_xs": "IQ4_XS",
}
LLAMACPP_ALIASES = {"q3_k": "q3_k_m", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}
# llama.cpp file types its quantizer writes only with an importance matrix (`export-gguf --imatrix`): below about
# 3 bits a weight, rounding that ignores which input columns matter leaves an unusable model (llama-quant.cpp refuses).
IMATRIX_TYPES = {
    "iq1_s": "IQ1_S",
    "iq1_m": "IQ1_M",
    "iq2_xxs": "IQ2_XXS",
    "iq2_xs": "IQ2_XS",
    "iq2_s": "IQ2_S",
    "iq2_m": "IQ2_M",
    "iq3_xxs": "IQ3_XXS",
    "iq3_xs": "IQ3_XS",
    "q2_k_s": "Q2_K_S",
}
# Types headlab writes itself that `export-gguf --gptq` can round against calibration inputs: ggml's symmetric block
# types, whose scale rule GPTQ can keep (headlab.runtimes.gptq.GRIDS).
GPTQ_TYPES = ("q8_0", "q5_0", "q4_0")
