"""The names and defaults the recovery options choose among, torch-free so the CLI builds its options without
importing torch."""

COMPENSATIONS = ("ridge", "bias")  # closed-form refits of o_proj (headlab.recovery.compensate)
STAGES = ("local", "uptrain")  # recovery stages, in pipeline order (headlab.recovery.recover)
TRAINED = ("attention", "norms", "all")  # parameters uptraining trains (headlab.recovery.uptrain)
# kl_layers: KL plus layer-output matching (headlab.recovery.uptrain.layer_matching_loss)
OBJECTIVES = ("kl", "ce", "mixed", "kl_layers")
# Uptraining under torchrun: data (every rank a whole copy, gradients all-reduced) or fsdp (FSDP2: parameters,
# gradients and AdamW state sharded over the ranks; headlab.recovery.fsdp).
PARALLEL = ("data", "fsdp")
# Under fsdp, where the trained values are gathered whole at the end (headlab.recovery.fsdp.sharded)
WHOLE_AFTER = ("every rank", "rank 0")
# What uptraining's long windows hold: text (calibration windows) or retrieval (synthetic needle prompts over the
# calibration text, scored on the answer: headlab.recovery.retrieval_windows).
LONG_KINDS = ("text", "retrieval")
# The default recipe: 128 steps of 4 x 256 tokens (131,072 tokens) at a peak lr of 1.5e-5. Out-of-domain recovery
# tracks the budget more than any other setting measured, and half the former lr over twice the steps recovers a close
# student (an svd merge, MLA) further on every domain and a far one (mean pooling) as far as 64 steps at 3e-5 did.
# Chosen on the recipe benchmark, never on the eval split; the evidence is in docs/recovery.md. A step budget trains
# the same model on any machine.
DEFAULT_LR = 1.5e-5
DEFAULT_STEPS = 128
# Where uptraining runs in bfloat16 autocast unless told (headlab.recovery.uptrain.default_bf16), for the help texts
BF16_DEFAULT = "on CUDA and on CPUs with native bfloat16 kernels (AVX512-BF16, AMX)"
# How a window sampled from the teacher begins: bos (its prefix token alone) or random (then a uniformly drawn ordinary
# token, as LLM-QAT starts its samples; headlab.recovery.teacher_samples)
GENERATED_STARTS = ("bos", "random")
# --generated / --recover-generated (UptrainConfig.generated; headlab.recovery.teacher_samples)
GENERATED_HELP = (
    "share of each batch's windows sampled from the teacher itself (temperature 1, from its BOS token) instead of "
    "taken from the calibration text: distillation on the model's own distribution, which restores it beyond the "
    "calibration domains (LLM-QAT); sampling adds time"
)
# convert-mla's recovery: half of each batch sampled from the teacher, each window from a random first token
# (--recover-generated 0.5 --recover-generated-start random), measured better than calibration text alone on every
# domain for MLA at the MQA budget (docs/recovery.md, the default recipe)
MLA_RECOVERY_GENERATED = 0.5
MLA_RECOVERY_GENERATED_START = "random"
