"""The same long-context prompts in transformers and in llama.cpp, prompt by prompt, on the embedded model and on one
compressed GGUF (3 -> 1 KV heads by the svd merge), both exported in f32: each runtime decodes greedily from one
prefill, and each prompt's answer is compared as text. Passkey and multi-key needles at 1k and 2k tokens, depths 0,
0.5 and 1, 2 prompts each, haystacks from the `broad` eval split."""

from __future__ import annotations

TITLE = "Long-context answers in transformers and llama.cpp, prompt by prompt (`longeval --runtime llamacpp`)"
TASKS = ("passkey", "niah_multikey")
LENGTHS, DEPTHS, SAMPLES = (1024, 2048), (0.0, 0.5, 1.0), 2
CALIB_TOKENS = 2048


def run(args) -> dict:
    import copy
    import tempfile
    import time
    from pathlib import Path

    import torch

    from headlab.core.data import TextSpec, load_corpus
    from headlab.core.loading import from_model, load_model
    from headlab.kv import gqa
    from headlab.measure.longctx import long_context
    from headlab.runtimes.gguf_export import export_gguf
    from headlab.runtimes.long_context import llamacpp_generate

    corpus = load_corpus("broad")
    original = load_model(None, device=args.device)
    calibration = TextSpec(corpus, split="calibration", seq_len=512, batch_size=4, max_tokens=CALIB_TOKENS)
    merged = from_model(copy.deepcopy(original.model), original.tokenizer)
    gqa.convert(merged, 1, method="svd", batches=calibration.batches(original.tokenizer))
    text = TextSpec(corpus, split="eval", max_tokens=None)
    common = dict(text=text, tasks=TASKS, lengths=LENGTHS, depths=DEPTHS, samples=SAMPLES,
                  position_sequences_count=0, progress=False)  # fmt: skip
    result = {"lengths": list(LENGTHS), "depths": list(DEPTHS), "samples": SAMPLES, "tasks": list(TASKS),
              "threads": torch.get_num_threads(), "rows": [], "differences": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for label, loaded in (("original", original), ("3 -> 1 KV heads, svd merge", merged)):
            path = Path(tmp) / "model.gguf"
            export_gguf(loaded, path, outtype="f32", overwrite=True, progress=False)
            start = time.perf_counter()
            ours = long_context(loaded, **common).prompts
            middle = time.perf_counter()
            theirs = long_context(loaded, generate=llamacpp_generate(loaded, path), **common).prompts
            end = time.perf_counter()
            same = ours["generated"] == theirs["generated"]
            for (task, length), group in ours.assign(same=same, theirs_correct=theirs["correct"]).groupby(
                ["task", "length"]
            ):
                result["rows"].append({"model": label, "task": task, "length": int(length), "prompts": len(group),
                                       "same_answer": int(group["same"].sum()),
                                       "correct_transformers": int(group["correct"].sum()),
                                       "correct_llamacpp": int(group["theirs_correct"].sum())})  # fmt: skip
            for i in (~same).to_numpy().nonzero()[0]:
                result["differences"].append({"model": label, "task": ours["task"][i], "length": int(ours["length"][i]),
                                              "depth": float(ours["depth"][i]), "answers": ours["answers"][i],
                                              "transformers": ours["generated"][i],
                                              "llamacpp": theirs["generated"][i]})  # fmt: skip
            result.setdefault("seconds", {})[label] = {"transformers": middle - start, "llamacpp": end - middle}
            print(result["rows"][-len(TASKS) * len(LENGTHS) :], flush=True)
    return result


def markdown(r: dict) -> str:
    lines = [
        f"Embedded SmolLM2-135M and its 3 -> 1 svd merge, each exported to GGUF f32; {len(r['depths']) * r['samples']} "
        f"prompts per task and length; greedy decoding in both runtimes ({r['threads']} threads). `same`: prompts whose "
        "answer text is identical in both runtimes.",
        "",
        "| model | task | length | same | correct (transformers) | correct (llama.cpp) |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['model']} | {row['task']} | {row['length']:,} | {row['same_answer']}/{row['prompts']} | "
            f"{row['correct_transformers']}/{row['prompts']} | {row['correct_llamacpp']}/{row['prompts']} |"
        )
    if r["differences"]:
        lines += ["", "Prompts answered differently:", ""]
        for d in r["differences"]:
            lines.append(
                f"- {d['model']}, {d['task']} at {d['length']:,}, depth {d['depth']:g} (answer {d['answers']}): "
                f"transformers `{d['transformers']}`, llama.cpp `{d['llamacpp']}`"
            )
    else:
        lines += ["", "Every prompt got the same answer text in both runtimes."]
    return "\n".join(lines)
