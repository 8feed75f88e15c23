"""The output directory `headlab demo` chooses by default, torch-free so the CLI builds its options without
importing torch."""

from pathlib import Path

DEMO_OUT = Path("runs/demo")
