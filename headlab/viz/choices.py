"""The figure formats `headlab plot` and `report` choose among, torch-free so the CLI builds its options without
importing torch (or matplotlib)."""

FORMATS = ("png", "svg", "pdf")
