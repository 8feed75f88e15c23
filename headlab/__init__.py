"""headlab: per-head analysis, importance, pruning and GQA conversion for Hugging Face transformers models."""

__version__ = "0.1.0"

from headlab.core.errors import HeadlabError  # noqa: E402

__all__ = ["HeadlabError", "__version__"]
