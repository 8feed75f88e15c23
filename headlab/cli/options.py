"""Options shared by every command (model, data, windows, output), so each means the same everywhere."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import click

from headlab.cli.parsing import parse_bytes
from headlab.core.data import PARTS, TextSpec
from headlab.core.errors import HeadlabError
from headlab.core.fsio import RUN_DIR_BYTES, check_free_space, check_replaceable, guard_output
from headlab.core.model_names import DEFAULT_MODEL, DEVICE_MAPS, DTYPE_NAMES
from headlab.kv.methods import RETRIEVAL_KINDS
from headlab.mechanisms.choices import KV_CACHES


@dataclass(frozen=True)
class ModelSpec:
    """The model a command runs on (--model, --device, --dtype, --device-map, --check-weights): `spec` None (the
    embedded default), a checkpoint directory, a .gguf file or a hub id. Calling it loads it (load_model)."""

    spec: str | None = None
    device: str | None = "auto"
    dtype: str | None = None
    device_map: str | None = None
    check_weights: bool = True
    max_memory: int | None = None  # bytes per device under --device-map auto; the rest offloaded to disk

    def load(self, **overrides):
        """The LoadedModel, with any load_model keyword overridden (e.g. dtype="float32")."""
        from headlab.core.loading import load_model  # start-up: torch and transformers load with the first model

        options = dict(device=self.device, dtype=self.dtype, device_map=self.device_map, max_memory=self.max_memory)
        return load_model(self.spec, **(options | {"check_weights": self.check_weights} | overrides))

    __call__ = load

    def streamed_source(self):
        """The local checkpoint directory a --streaming edit reads; --dtype and --device-map are refused, since
        nothing is loaded onto a device (tensors are read and written in their stored dtype)."""
        from headlab.core.loading import local_checkpoint  # start-up: torch loads with it, not for --help

        if self.dtype is not None or self.device_map is not None:
            raise HeadlabError(
                "--streaming never loads the model: it keeps the stored dtype; drop --dtype/--device-map"
            )
        return local_checkpoint(self.spec)


def model_options(function):
    """--model, --device, --dtype, --device-map, --max-memory, --check-weights."""

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
        type=click.Choice(DTYPE_NAMES),
        default=None,
        help="weights dtype [default: float32 on CPU, bfloat16 on CUDA]",
    )
    @click.option(
        "--device-map",
        type=click.Choice(DEVICE_MAPS),
        default=None,
        help="spread a model larger than one GPU over the available devices (accelerate)",
    )
    @click.option(
        "--max-memory",
        default=None,
        metavar="SIZE",
        help="with --device-map auto: the most the layers may take on each device (e.g. 8GiB); the rest is offloaded "
        "to disk and read back at every forward pass (slow, but a model larger than memory runs)",
    )
    @click.option(
        "--check-weights/--no-check-weights",
        default=True,
        show_default=True,
        help="refuse a model with a non-finite (nan/inf) weight, naming the tensor (one cheap pass on load)",
    )
    @functools.wraps(function)
    def wrapper(*args, model_spec, device, dtype, device_map, max_memory, check_weights, **kwargs):
        # The command receives the model as a spec it loads by calling it (load(), load(dtype=...)); commands that
        # read checkpoint files without loading the model (convert-gqa --streaming) use its fields.
        if max_memory is not None and device_map is None:
            raise HeadlabError("--max-memory caps what --device-map auto puts on each device: add --device-map auto")
        limit = None if max_memory is None else parse_bytes(max_memory, "max-memory")
        load = ModelSpec(model_spec, device, dtype, device_map, check_weights, limit)
        return function(*args, load=load, **kwargs)

    return wrapper


def corpus_options(
    default_split: str,
    split_help: str = "which part of the corpus to use (calibration and eval are disjoint)",
    data_help: str = "corpus",
):
    """--data, --text-column, --split: the corpus a command reads and its part; the command receives data,
    text_column and part (data_options builds a TextSpec from them)."""

    def decorate(function):
        function = click.option(
            "--split", "part", type=click.Choice(PARTS), default=default_split, show_default=True, help=split_help
        )(function)
        function = click.option("--text-column", default=None, help="text column of a table corpus [default: text]")(
            function
        )
        return click.option(
            "--data",
            default=None,
            metavar="SPEC",
            help=f"{data_help}: a built-in corpus (broad; prose, dialogue, code, docs, speeches, encyclopedia, "
            "poetry; pydoc-topics), a .txt/.jsonl/.csv/.parquet file, a datasets directory or a hub "
            "'name:config:split' [default: broad, prose + dialogue + code + docs]",
        )(function)

    return decorate


def data_options(
    default_split: str,
    max_tokens: int | None,
    seq_len: int,
    batch_size: int,
    perplexity_windows: bool = False,
    max_tokens_help: str = "bound on the tokens processed",
):
    """--data, --text-column, --split, --max-tokens, --seq-len, --batch-size with a command's own defaults; the
    command receives them as one `text: TextSpec` (headlab.core.data).

    max_tokens_help: what --max-tokens bounds in this command, where it is not every token the command reads (prune
    and sweep read calibration text under --calibration-tokens besides the eval text --max-tokens bounds).

    perplexity_windows: the window option is --max-length (lm-eval's name and meaning: model input tokens per
    window, each scoring as many predictions) with --seq-len kept as the same option, since both count the tokens
    fed to the model; the value still arrives as `seq_len`.
    """
    window_names = ("--max-length", "--seq-len", "seq_len") if perplexity_windows else ("--seq-len", "seq_len")
    window_help = (
        "model input tokens per perplexity window, as lm-eval's max_length (--seq-len is the same option)"
        if perplexity_windows
        else "tokens per window"
    )

    def decorate(function):
        @corpus_options(default_split)
        @click.option(
            "--max-tokens",
            type=click.IntRange(min=1),
            default=max_tokens,
            show_default=True,
            help=max_tokens_help,
        )
        @click.option(*window_names, type=click.IntRange(min=1), default=seq_len, show_default=True, help=window_help)
        @click.option(
            "--batch-size",
            type=click.IntRange(min=1),
            default=batch_size,
            show_default=True,
            help="windows per forward pass",
        )
        @functools.wraps(function)
        def wrapper(*args, data, text_column, part, max_tokens, seq_len, batch_size, **kwargs):
            text = TextSpec(data, text_column, part, seq_len, batch_size, max_tokens)
            return function(*args, text=text, **kwargs)

        return wrapper

    return decorate


def out_option(required: bool = True, help_text: str = "output directory (written atomically)"):
    def decorate(function):
        function = click.option("--overwrite", is_flag=True, help="replace an existing output directory")(function)
        return click.option("--out", "out", type=click.Path(path_type=Path), required=required, help=help_text)(
            function
        )

    return decorate


def streaming_options(verb: str):
    """--streaming and --max-shard-size, for the commands that can edit a checkpoint layer by layer (`verb`: what
    they do to it)."""

    def decorate(function):
        function = click.option(
            "--max-shard-size",
            default="5GB",
            show_default=True,
            help="with --streaming: largest output shard (shards are written in place on disk: peak memory is "
            "about one block or the largest tensor)",
        )(function)
        return click.option(
            "--streaming",
            is_flag=True,
            help=f"{verb} a local safetensors checkpoint one block at a time, never holding the whole model (for "
            "models larger than memory); keeps the stored dtype, checks the result structurally, no perplexity",
        )(function)

    return decorate


def _local(spec) -> Path | None:
    """A --data/--scores/--mask value as a local path when it names one (a hub data set or the embedded corpus
    does not)."""
    return None if spec is None else Path(spec).expanduser()


def check_input_kind(path: Path | None, label: str) -> None:
    """An input that exists but is neither a regular file nor a folder (a FIFO, a device, a broken link): refused as
    what it is; each reader would otherwise call it missing ("no such score table") or block reading a FIFO."""
    if path is None or not os.path.lexists(path) or path.is_file() or path.is_dir():
        return
    if path.is_symlink() and not path.exists():
        raise HeadlabError(f"{label} {path} is a broken link (to {os.readlink(path)})")
    raise HeadlabError(f"{label} {path} is not a regular file or folder (a FIFO or device?)")


def guard(out, overwrite: bool, models: dict, *, data=None, run_dir_bytes: bool = True, **tables) -> None:
    """The output guard of a writing command (headlab.core.fsio.guard_output), before anything is loaded: `out` is not,
    does not contain and does not lie inside a model, the corpus or a table the command reads.
    `models`: label -> spec (None: the embedded default); `tables`: option name -> path. run_dir_bytes: also
    require RUN_DIR_BYTES free (commands that write checkpoints check their size after loading instead)."""
    from headlab.core.loading import model_location  # start-up: the guard runs after parsing, not for --help

    inputs = {label: model_location(spec) for label, spec in models.items()}
    inputs["corpus (--data)"] = _local(data)
    inputs.update({f"table (--{name})": _local(path) for name, path in tables.items()})
    for label, path in inputs.items():
        check_input_kind(path, label)
    guard_output(out, overwrite, inputs)
    if overwrite and out is not None and os.path.lexists(out):
        check_replaceable(out)  # only a previous headlab output or an empty folder is replaced, whatever follows
    if run_dir_bytes:
        check_free_space(out, RUN_DIR_BYTES, "tables, figures and metadata, assumed at most 16 MiB")


def guard_checkpoint_space(out, loaded, extra: int = 0) -> None:
    """Before the first forward pass: room for a checkpoint of the loaded model (its parameter and buffer bytes, in
    the dtype it runs in; pruning and KV pooling only shrink it, `extra` is what KV expansion adds)."""
    from headlab.core.loading import weight_bytes  # start-up: torch loads with the model, not for --help

    check_free_space(out, weight_bytes(loaded.model) + extra, "the loaded model's weights in its dtype")


def allow_foreign_option(function):
    """--allow-foreign-scores: use a score or mask run whose meta.json names another model or head layout."""
    return click.option(
        "--allow-foreign-scores",
        is_flag=True,
        help="use a score or mask table whose run metadata names another model or head layout",
    )(function)


def calibration_tokens_option(default: int, help_text: str):
    """--calibration-tokens (one name in every command); `help_text` says what the budget bounds and what it costs."""
    return click.option(
        "--calibration-tokens", type=click.IntRange(min=1), default=default, show_default=True, help=help_text
    )


def retrieval_len_option(help_text: str):
    """--retrieval-len: tokens per synthetic retrieval prompt of a per-layer budget's retrieval cost (1,024)."""
    return click.option("--retrieval-len", type=click.IntRange(min=1), default=1024, show_default=True, help=help_text)


def retrieval_kind_option(help_text: str):
    """--retrieval-kind: what a per-layer budget's retrieval cost scores (headlab.kv.methods.RETRIEVAL_KINDS)."""
    return click.option(
        "--retrieval-kind",
        type=click.Choice(RETRIEVAL_KINDS),
        default="needles",
        show_default=True,
        help=help_text + ": what the retrieval cost scores: needles (the answers of needle and multi-key prompts) or "
        "copy (random tokens followed by their copy, scored on every copied token: docs/long-context.md)",
    )


def refine_rounds_option(help_text: str):
    """--refine-rounds: rounds of local search on a per-layer budget's layout (headlab.kv.budget.refine_counts)."""
    return click.option("--refine-rounds", type=click.IntRange(min=0), default=0, show_default=True, help=help_text)


def low_memory_option(function):
    """--low-memory/--no-low-memory for commands whose gradient pass chooses by the memory available (None)."""
    return click.option(
        "--low-memory/--no-low-memory",
        default=None,
        help="gradient scores one sequence per backward pass with recomputed blocks: the same scores in a fraction "
        "of the memory, about 3x the time on a CPU [default: only when whole batches would not fit in the memory "
        "available]",
    )(function)


def task_options(help_text: str):
    """--tasks NAMES and --include-path DIR (lm-eval tasks and local task YAMLs), with the command's own --tasks help."""

    def decorate(function):
        function = click.option(
            "--include-path", default=None, metavar="DIR", help="directory of local lm-eval task YAMLs"
        )(function)
        return click.option("--tasks", default=None, metavar="NAMES", help=help_text)(function)

    return decorate


def compensate_option(choices, help_text: str):
    """--compensate CHOICE (the caller passes headlab.recovery.compensate.COMPENSATIONS: importing it here would load
    pandas at every command's start-up); the bare flag means ridge."""
    return click.option(
        "--compensate",
        type=click.Choice(choices),
        is_flag=False,
        flag_value="ridge",
        default=None,
        help=help_text,
    )


def kv_policy_option(function):
    """--kv-policy DIR (as `kv_policy`): run the model under a `headlab kv-policy` run's per-KV-head cache policy."""
    return click.option(
        "--kv-policy",
        "kv_policy",
        type=click.Path(path_type=Path),
        default=None,
        metavar="DIR",
        help="run under the per-KV-head cache policy of a `headlab kv-policy` run: its streaming heads see only "
        "sinks + window (docs/kv-policy.md)",
    )(function)


def kv_cache_option(function):
    """--kv-cache SPEC (as `kv_cache`): the KV cache the model reads back, full or quantized (transformers'
    QuantizedCache; headlab.mechanisms.quantized_cache), shared by eval, longeval and speed."""
    return click.option(
        "--kv-cache",
        "kv_cache",
        type=click.Choice(list(KV_CACHES)),
        default="full",
        show_default=True,
        help="KV cache: full (the model's dtype), fp8 (float8 e4m3, one scale per tensor), or quanto/hqq integers "
        "(groups of 64, the newest <128 tokens kept full; -kivi: KIVI's grouping, keys per channel, values per "
        "token; the quanto and hqq backends need the kvquant extra); docs/kv-cache.md",
    )(function)


def read_text_option(text, text_file) -> str | None:
    """The text of --text or --text-file (UTF-8), at most one of them given; None when neither is."""
    if text is not None and text_file is not None:
        raise HeadlabError("give --text or --text-file, not both")
    if text_file is None:
        return text
    check_input_kind(text_file, "--text-file")
    if not text_file.is_file():
        raise HeadlabError(f"--text-file {text_file}: no such file")
    try:
        return text_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise HeadlabError(f"--text-file {text_file}: cannot read it as UTF-8 text ({type(error).__name__})") from None


def print_rows(rows: list[tuple[str, str]]) -> None:
    """The two-column summary every command prints: each fact's name, padded to the longest, then its value."""
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"{name:<{width}}  {value}")
