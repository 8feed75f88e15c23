"""Making an edited model good again: closed-form compensation, layer-wise reconstruction, uptraining by
distillation, and the pipeline that chains them.
"""

__all__ = ["choices", "compensate", "fsdp", "reconstruct", "recover", "retrieval_windows", "teacher_samples", "uptrain"]
