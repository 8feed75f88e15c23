"""The end-to-end report behind `headlab report` and `headlab demo`, and its rendering to Markdown and HTML."""

__all__ = ["choices", "heads", "render", "report"]
