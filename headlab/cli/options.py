"""Options shared by every command (model, data, windows, output), so each means the same everywhere."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from headlab.data import PARTS
from headlab.loading import DEFAULT_MODEL, DEVICE_MAPS, DTYPES, LoadedModel, load_model


def model_options(function):
    """--model, --device, --dtype, --device-map."""

    @click.option(
        "--model",
        "model_spec",
        default=None,
        metavar="SPEC",
        help=f"hub id, local checkpoint directory or .gguf file [default: embedded {DEFAULT_MODEL}]",
    )
    @click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto")
    @click.option(
        "--dtype",
        type=click.Choice(list(DTYPES)),
        default=None,
        help="weights dtype [default: float32 on CPU, bfloat16 on CUDA]",
    )
    @click.option(
        "--device-map",
        type=click.Choice(DEVICE_MAPS),
        default=None,
        help="spread a model larger than one GPU over the available devices (accelerate)",
    )
    @functools.wraps(function)
    def wrapper(*args, model_spec, device, dtype, device_map, **kwargs):
        def load(**overrides) -> LoadedModel:
            return load_model(model_spec, device=device, dtype=dtype, device_map=device_map, **overrides)

        # For commands that can read the checkpoint files without loading the model (convert-gqa --streaming).
        load.spec, load.dtype, load.device_map = model_spec, dtype, device_map
        return function(*args, load=load, **kwargs)

    return wrapper


def data_options(default_split: str, max_tokens: int | None, seq_len: int, batch_size: int):
    """--data, --text-column, --split, --max-tokens, --seq-len, --batch-size with a command's own defaults."""

    def decorate(function):
        @click.option(
            "--data",
            default=None,
            metavar="SPEC",
            help="corpus: .txt/.jsonl/.csv/.parquet file, datasets directory or hub 'name:config:split' "
            "[default: embedded Python reference text]",
        )
        @click.option("--text-column", default=None, help="text column of a table corpus [default: text]")
        @click.option(
            "--split",
            "part",
            type=click.Choice(PARTS),
            default=default_split,
            show_default=True,
            help="which part of the corpus to use (calibration and eval are disjoint)",
        )
        @click.option(
            "--max-tokens",
            type=click.IntRange(min=1),
            default=max_tokens,
            show_default=True,
            help="bound on the tokens processed",
        )
        @click.option(
            "--seq-len", type=click.IntRange(min=1), default=seq_len, show_default=True, help="tokens per window"
        )
        @click.option(
            "--batch-size",
            type=click.IntRange(min=1),
            default=batch_size,
            show_default=True,
            help="windows per forward pass",
        )
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            return function(*args, **kwargs)

        return wrapper

    return decorate


def out_option(required: bool = True, help_text: str = "output directory (written atomically)"):
    def decorate(function):
        function = click.option("--overwrite", is_flag=True, help="replace an existing output directory")(function)
        return click.option("--out", "out", type=click.Path(path_type=Path), required=required, help=help_text)(
            function
        )

    return decorate
