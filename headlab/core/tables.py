"""Tidy result tables and run directories: every command writes CSV + Parquet tables and a metadata JSON, atomically.

A run directory holds `<name>.csv`, `<name>.parquet` for each table and `meta.json` (what ran, on what, with which
versions), so `headlab plot` and the report can redraw everything without a model.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pandas as pd
import torch
import transformers

from headlab import __version__
from headlab.core import distributed
from headlab.core.fsio import atomic_directory, json_text


def versions() -> dict:
    return {
        "headlab": __version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def head_name(layer: int, head: int) -> str:
    """TransformerLens' name of a head, "L{layer}H{head}" (layer: headlab's attention-layer index, the block index
    except in hybrid models, whose linear-attention blocks are not counted)."""
    return f"L{int(layer)}H{int(head)}"


def head_table(layers, values: dict[str, list]) -> pd.DataFrame:
    """A per-head table with `layer, head, kv_head` first; `values` columns are flat lists in (layer, head) order."""
    rows = [(layer.index, head, layer.kv_head_of(head)) for layer in layers for head in range(layer.num_heads)]
    frame = pd.DataFrame(rows, columns=["layer", "head", "kv_head"])
    for name, column in values.items():
        frame[name] = column
    return frame


def write_run(
    out: Path,
    tables: dict[str, pd.DataFrame],
    meta: dict,
    *,
    overwrite: bool = False,
    extra_files: dict[str, str | bytes] | None = None,
) -> Path:
    """Write tables (CSV and Parquet), meta.json and extra files into `out`, all or nothing (rank 0 only)."""
    out = Path(out)
    if not distributed.is_main():
        return out
    with atomic_directory(out, overwrite=overwrite) as tmp:
        write_run_files(tmp, tables, meta, extra_files)
    return out


def write_run_files(directory: Path, tables: dict[str, pd.DataFrame], meta: dict, extra_files=None) -> None:
    """The files of a run directory (tables as CSV and Parquet, meta.json, extra files) written into `directory`,
    which is itself a staging directory (atomic_directory, resumable_directory)."""
    for name, frame in tables.items():
        frame.to_csv(directory / f"{name}.csv", index=False)
        frame.to_parquet(directory / f"{name}.parquet", index=False)
    (directory / "meta.json").write_text(json_text({**meta, "versions": versions()}))
    for name, content in (extra_files or {}).items():
        mode = "wb" if isinstance(content, bytes) else "w"
        (directory / name).parent.mkdir(parents=True, exist_ok=True)  # names may hold subfolders (figures/x.png)
        with open(directory / name, mode) as handle:
            handle.write(content)


def read_run(path: Path) -> tuple[dict[str, pd.DataFrame], dict]:
    """Tables (from CSV) and metadata of a run directory."""
    path = Path(path)
    tables = {csv.stem: pd.read_csv(csv) for csv in sorted(path.glob("*.csv"))}
    meta_path = path / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return tables, meta
