"""The walkthrough notebook runs top to bottom on a tiny saved model and a small text file (its parameter cell
overridden), so that it cannot rot; it is committed without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
from tiny_text import SAMPLE_TEXT, save_tiny

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "walkthrough.ipynb"


def test_notebook_is_committed_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code)
    assert sum("parameters" in cell.metadata.get("tags", []) for cell in code) == 1


def test_notebook_runs_on_a_tiny_model(tmp_path):
    from nbclient import NotebookClient

    checkpoint = save_tiny("llama", tmp_path / "tiny")
    corpus = tmp_path / "text.txt"
    corpus.write_text(SAMPLE_TEXT * 4)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    index = next(i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", []))
    overrides = (
        f"MODEL = {str(checkpoint)!r}\nDATA = {str(corpus)!r}\nTOKENS = 128\nSEQ_LEN = 32\nINDUCTION_LEN = 8\n"
        f"SENTENCE = 'The cat sat.'\nOUT = {str(tmp_path / 'out')!r}"
    )
    notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(overrides))  # papermill's way: parameters win
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 6  # heatmaps, scatter, GQA sweep, grouping, gallery are displayed
    text = "".join(o.get("text", "") for o in outputs)
    assert "KV heads 2 -> 1: perplexity" in text
