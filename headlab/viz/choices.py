"""The figure formats `headlab plot` and `report` choose among, torch-free so the CLI builds its options without
importing torch (or matplotlib)."""

FORMATS = ("png", "svg", "pdf")

# Query rows per page of `headlab show`'s viewer (headlab.viz.viewer): the page decodes one page of one head at a time.
DEFAULT_PAGE = 128
