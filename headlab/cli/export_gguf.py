"""`headlab export-gguf`: write a llama-family checkpoint (pruned or KV-reduced included) as a GGUF file for llama.cpp,
checked by llama.cpp itself when llama-cpp-python is installed."""

from __future__ import annotations

import json
from pathlib import Path

import click

from headlab.cli.options import calibration_tokens_option, data_options, guard, model_options, print_rows
from headlab.core.errors import HeadlabError
from headlab.core.units import human_bytes
from headlab.runtimes.choices import DEFAULT_TYPE, GPTQ_TYPES, IMATRIX_TYPES, LLAMACPP_TYPES


class SmoothingAlpha(click.ParamType):
    """A number in [0, 1] or "auto" (headlab.runtimes.smoothing.AUTO)."""

    name = "[0..1|auto]"

    def get_metavar(self, param, ctx=None):  # click upper-cases `name` otherwise; ctx is absent before click 8.2
        return self.name

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            return value
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is None or not 0 <= number <= 1:
            self.fail(f"{value!r} is not a number in [0, 1] or 'auto'", param, ctx)
        return number


@click.command("export-gguf")
@model_options
@data_options(default_split="eval", max_tokens=512, seq_len=256, batch_size=1)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="GGUF file to write (atomically)")
@click.option("--overwrite", is_flag=True, help="replace an existing file")
@click.option(
    "--outtype",
    default=DEFAULT_TYPE,
    show_default=True,
    help="f32, f16, bf16 or a type the gguf package quantizes (q8_0, q4_0, ...), written by headlab; or a llama.cpp "
    f"file type ({', '.join(LLAMACPP_TYPES)}; case-insensitive), written as f32 and quantized by llama.cpp "
    "(llama-cpp-python); vectors stay f32",
)
@click.option(
    "--verify/--no-verify",
    default=None,
    help="load the file in llama.cpp and compare log-probabilities with transformers on the eval split "
    "[default: when llama-cpp-python is installed]",
)
@click.option(
    "--imatrix",
    is_flag=True,
    help="give llama.cpp's quantizer an importance matrix (what llama-imatrix measures: each matrix's mean squared "
    "inputs) from --calibration-tokens of the corpus's calibration part; llama.cpp types only, and required by "
    f"{', '.join(IMATRIX_TYPES)}",
)
@click.option(
    "--gptq",
    is_flag=True,
    help="round each matrix by GPTQ (each column's rounding error moved onto the columns not yet rounded, against "
    "its inputs on --calibration-tokens of the corpus's calibration part) instead of to nearest; still plain "
    f"ggml blocks; for {', '.join(GPTQ_TYPES)}, and a llama.cpp type's matrices its recipe puts in those",
)
@click.option(
    "--smooth",
    is_flag=True,
    help="rescale every feed-forward's inputs exactly (SmoothQuant: range moved from activation outliers into the "
    "weights, from their maxima on --calibration-tokens of the corpus's calibration part), so that llama.cpp's "
    "8-bit activation rounding in quantized products loses less; the importance matrix and GPTQ see the rescaled "
    "inputs",
)
@click.option(
    "--smooth-alpha",
    type=SmoothingAlpha(),
    default="0.5",
    show_default=True,
    help="with --smooth: s = max|x|^alpha / max|W|^(1 - alpha); 0 leaves activations alone, 1 moves all their range; "
    "'auto' picks, for each feed-forward input, alpha 0, 0.25, ..., 1 or no rescaling by the error of llama.cpp's "
    "rounded product on calibration tokens (q8_0, q5_0 and q4_0 files)",
)
@calibration_tokens_option(
    8192, "calibration tokens for --imatrix, --gptq or --smooth (windows of 512; one forward pass each)"
)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def command(load, text, out, overwrite, outtype, verify, imatrix, gptq, smooth, smooth_alpha, calibration_tokens,
            as_json):  # fmt: skip
    """Export to GGUF: llama/SmolLM2, mistral, qwen2, qwen3, and deepseek_v3 with dense MLPs (MLA, llama.cpp's
    `deepseek2`); per-layer head counts go to llama.cpp's `deci` architecture (the one whose graph builds each layer
    with its own head counts)."""
    # start-up: torch and gguf load when the command runs, not for --help
    from headlab.runtimes.gguf_export import check_type, export_gguf
    from headlab.runtimes.llamacpp import compare_logprobs, eval_windows, unavailable, window_length
    from headlab.runtimes.smoothing import check_alpha

    # the one output guard: never onto, around or inside the model or the corpus it reads (symlinks resolved)
    guard(out, overwrite, {"model": load.spec}, data=text.data, run_dir_bytes=False)
    if out.is_dir():  # before loading: a folder is never replaced by a file
        raise HeadlabError(f"--out {out} is a directory; export-gguf writes one .gguf file")
    outtype = check_type(outtype, imatrix, gptq)
    if smooth:
        check_alpha(smooth_alpha, outtype)
    missing = unavailable()
    if verify and missing:
        raise HeadlabError(f"--verify needs llama.cpp: {missing}")
    verify = not missing if verify is None else verify
    calibrated = imatrix or gptq or smooth
    text = text.resolved() if calibrated else text  # one corpus load for the calibration and the eval part
    loaded = load()
    check, notes, calibration = None, [], None
    if calibrated:
        window = min(512, loaded.max_positions or 512)
        spec = text.but(split="calibration", max_tokens=calibration_tokens, seq_len=window, batch_size=4)
        calibration = spec.batches(loaded.tokenizer, max_positions=loaded.max_positions)
    if verify:
        windows = eval_windows(loaded, text=text)
        if window_length(loaded, text.seq_len) < text.seq_len:
            notes.append(
                f"verified in windows of {window_length(loaded, text.seq_len)} tokens, the model's max positions "
                f"(not --seq-len {text.seq_len})"
            )

        def check(path):
            return compare_logprobs(loaded, path, windows, progress=not as_json)

    record = export_gguf(loaded, out, outtype=outtype, overwrite=overwrite, progress=not as_json, verify=check,
                         imatrix=calibration if imatrix else None, gptq=calibration if gptq else None,
                         smooth=calibration if smooth else None, smooth_alpha=smooth_alpha)  # fmt: skip
    record["notes"] = record["notes"] + notes
    if as_json:
        click.echo(json.dumps(record, indent=2))
        return
    print_rows(_summary_rows(record, missing))


def _summary_rows(record: dict, missing: str | None) -> list[tuple[str, str]]:
    """The export's summary as (label, value) rows: the file, layout, tensor types and tokenizer; the llama.cpp check
    (or why it was skipped: `missing`); the quantizer, importance matrix, smoothing and GPTQ; the notes."""
    rows = [
        ("file", f"{record['out']} ({human_bytes(record['bytes'])}, {record['outtype']})"),
        ("llama.cpp architecture", record["architecture"] + ("" if record["uniform"] else " (per-layer head counts)")),
        ("heads / KV heads", _counts(record["head_count"], record["head_count_kv"])),
        ("tensors by type", ", ".join(f"{n} {name}" for name, n in record["tensor_type_counts"].items())),
        ("tokenizer", f"gpt2 BPE, pre-tokenizer {record['tokenizer_pre']}, chat template {record['chat_template']}"),
    ]
    result = record.get("verification")
    if result:
        rows += [
            (
                "perplexity (llama.cpp / transformers)",
                f"{result['perplexity_llamacpp']:.4f} / {result['perplexity_transformers']:.4f} "
                f"({100 * result['relative_difference']:.3f}% apart, {result['scored_tokens']} tokens)",
            ),
            ("worst |logit diff|", f"{result['max_abs_logit_diff']:.3g} (max |logit| {result['max_abs_logit']:.3g})"),
        ]
    else:
        rows.append(("llama.cpp check", "skipped" + (f": {missing}" if missing else "")))
    quantization = record.get("quantization") or {}
    if quantization.get("by") == "llama.cpp":
        rows.append(
            (
                "quantized by",
                f"llama.cpp {quantization['ftype']} from {quantization['from']} (llama-cpp-python "
                f"{quantization['llama_cpp_python']}, ggml {quantization['ggml']}, commit {quantization['commit']})",
            )
        )
        weighted = quantization.get("imatrix")
        if weighted:
            without = weighted["matrices_without"]
            none_for = f"; none for {len(without)} ({', '.join(without[:2])}{', ...' * (len(without) > 2)})"
            used = f"{weighted['entries']} matrices, {weighted['tokens']} calibration tokens"
            rows.append(("importance matrix", used + (none_for if without else "")))
    smoothed = record.get("smoothing")
    if smoothed:
        low, high = smoothed["scale_range"]
        rows.append(("smoothing", f"SmoothQuant alpha {smoothed['alpha']} on {smoothed['blocks']} feed-forwards from "
                                  f"{smoothed['tokens']} calibration tokens; scales {low:.3g} to {high:.3g}"))  # fmt: skip
        if smoothed.get("chosen_alpha"):
            rows.append(("alphas chosen (inputs)", _alpha_counts(smoothed["chosen_alpha"])))
    rounded = quantization.get("gptq")
    if rounded:
        worst = rounded["worst_matrix"] or {}
        rows.append((
            "GPTQ",
            f"{rounded['matrices']} matrices from {rounded['tokens']} calibration tokens; output error "
            f"{rounded['output_error_vs_nearest']:.3f}x round to nearest's (worst {worst.get('name')}: "
            f"{worst.get('output_error_vs_nearest', float('nan')):.3f}x)",
        ))  # fmt: skip
    rows += [("note", note) for note in record["notes"]]
    return rows


def _counts(heads: list[int], kv_heads: list[int]) -> str:
    if len(set(zip(heads, kv_heads))) == 1:
        return f"{heads[0]} / {kv_heads[0]} in each of {len(heads)} layers"
    return f"{sum(heads)} / {sum(kv_heads)} in {len(heads)} layers: " + " ".join(
        f"{h}/{g}" for h, g in zip(heads, kv_heads)
    )


def _alpha_counts(chosen: dict) -> str:
    """How often each alpha was chosen over the feed-forward inputs of an "auto" smoothing ("0.75: 30, none: 23")."""
    counts: dict[str, int] = {}
    for pair in chosen.values():
        for alpha in pair:
            label = "none" if alpha is None else f"{alpha:g}"
            counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{label}: {n}" for label, n in sorted(counts.items(), key=lambda item: -item[1]))
