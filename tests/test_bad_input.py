"""Bad input to every command: exit 2, one stderr line, nothing written; fuzzed score/mask tables; --seed determinism.

One table of (command line, expected message fragment) cases drives the CLI checks; hypothesis drives the readers.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import hostile
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tiny_text import SAMPLE_TEXT, run_cli, save_tiny

from headlab.core.errors import HeadlabError
from headlab.core.loading import load_model
from headlab.mechanisms.gates import read_mask
from headlab.pruning.scores import read_scores

# ---- table-driven bad input -------------------------------------------------------------------------------------

# Placeholders in {braces} are paths from the `inputs` fixture; every case runs with the working directory set to an
# empty temporary directory, so any default output (gqa-sweep/, headlab-uptrain/, runs/demo/ ...) would show up.
M = ["--device", "cpu"]
NO_MODEL = ["--model", "{missing}", *M]
DATA = ["--data", "{text}", "--seq-len", "32"]
EVAL32 = ["--eval-seq-len", "32"]
TEXT = ["--data", "{text}"]  # report and demo take no --seq-len
ONTO_POLICY = ["--kv-policy", "{emptydir}", "--out", "{emptydir}", "--overwrite"]  # --out onto the policy it reads
CASES = [
    # info
    (["info", *NO_MODEL], "{missing}"),
    (["info", "--model", "{llama}", "--device", "tpu"], "tpu"),
    (["info", "--model", "{llama}", "--device", "cuda"], "cuda"),
    (["info", "--model", "{llama}", *M, "--context", "0"], "--context"),
    (["info", "--model", "{mixedshards}", *M], "a shard from another checkpoint or run"),
    # eval
    (["eval", *NO_MODEL, *DATA], "{missing}"),
    (["eval", "--model", "{mixedshards}", *M, *DATA], "a shard from another checkpoint or run"),
    (["eval", "--model", "{llama}", *M, *DATA, "--seq-len", "1000"], "1000"),
    (["eval", "--model", "{llama}", *M, "--data", "{missing}", "--seq-len", "32"], "{missing}"),
    (["eval", "--model", "{llama}", "--device", "cuda:7", *DATA], "cuda"),
    (["eval", "--model", "{llama}", *M, *TEXT, "--max-length", "65"], "maximum positions"),
    (["eval", "--model", "{llama}", *M, *DATA, "--out", "o"], "--tasks"),
    (["eval", "--model", "{llama}", *M, *DATA, "--domains", "speeches,wikipedia"], "wikipedia"),
    (["eval", "--model", "{llama}", *M, *DATA, "--kv-cache", "int4"], "int4"),
    (["eval", "--model", "{llama}", *M, *DATA, "--kv-chunk", "0"], "--kv-chunk"),
    (["eval", "--model", "{llama}", *M, *DATA, "--kv-cache", "fp8", "--tasks", "x"], "--tasks"),
    (["eval", "--model", "{llama}", *M, *DATA, "--kv-cache", "fp8", "--kv-policy", "{emptydir}"], "--kv-policy"),
    (["eval", "--model", "{bert}", *M, *DATA, "--kv-cache", "fp8"], "encoder"),
    (["longeval", "--model", "{llama}", *M, *TEXT, "--kv-cache", "fp4", "--out", "l"], "fp4"),
    (["longeval", "--model", "{llama}", *M, *TEXT, "--kv-cache", "fp8", "--runtime", "llamacpp"], "--kv-cache"),
    (["speed", "{llama}", "--device", "cpu", "--kv-cache", "int8", "--out", "s"], "int8"),
    # stats
    (["stats", *NO_MODEL, *DATA, "--out", "s"], "{missing}"),
    (["stats", "--model", "{llama}", *M, *DATA, "--out", "{existing}"], "--overwrite"),
    (["stats", "--model", "{llama}", *M, *DATA, "--no-induction", "--seq-len", "500", "--out", "s"], "500"),
    (["stats", "--model", "{llama}", *M, *DATA, "--detect", "magic", "--out", "s"], "magic"),
    (["stats", "--model", "{llama}", *M, *DATA, "--detect", "induction", "--detect-measure", "sq", "--out", "s"], "sq"),
    # importance
    (["importance", "--model", "{llama}", *M, *DATA, "--split", "eval", "--out", "i"], "--split eval"),
    (["importance", "--model", "{llama}", *M, *DATA, "--mask", "{badmask}", "--out", "i"], "{badmask}"),
    (["importance", "--model", "{llama}", *M, *DATA, "--out", "{existing}"], "--overwrite"),
    (
        ["importance", "--model", "{llama}", *M, *DATA, "--method", "taylor", "--bertology-compat", "--out", "i"],
        "--bertology-compat",
    ),
    # prune
    (["prune", "--model", "{llama}", *M, *DATA, "--fraction", "1.5", "--out", "p"], "1.5"),
    (["prune", "--model", "{llama}", *M, *DATA, "--heads", "9:0", "--out", "p"], "9"),
    (
        ["prune", "--model", "{llama}", *M, *DATA, "--scores", "{othertable}", "--fraction", "0.25", "--out", "p"],
        "another model",
    ),
    (["prune", "--model", "{llama}", *M, *DATA, "--heads", "0:0", "--out", "{existing}"], "--overwrite"),
    (["prune", *NO_MODEL, *DATA, "--heads", "0:0", "--out", "p"], "{missing}"),
    # prune: head selection (headlab.pruning.selection)
    (["prune", "--model", "{llama}", *M, *DATA, "--method", "magic", "--out", "p"], "magic"),
    (["prune", "--model", "{llama}", *M, *DATA, "--select", "oracle", "--out", "p"], "oracle"),
    (["prune", "--model", "{gpt2}", *M, *DATA, "--select", "obs", "--compensate", "bias", "--out", "p"], "ridge"),
    (["prune", "--model", "{llama}", *M, *DATA, "--select", "obs", "--iterative", "2", "--out", "p"], "greedy"),
    (["prune", "--model", "{llama}", *M, *DATA, "--select", "obs", "--heads", "0:1", "--out", "p"], "--heads"),
    (
        [
            "prune",
            "--model",
            "{llama}",
            *M,
            *DATA,
            "--select",
            "obs",
            "--budget",
            "uniform",
            "--count",
            "3",
            "--out",
            "p",
        ],
        "multiple of 4",
    ),  # fmt: skip
    (["prune", "--model", "{llama}", *M, *DATA, "--budget", "search", "--count", "7", "--out", "p"], "keeping one"),
    (["prune", "--model", "{llama}", *M, *DATA, "--budget", "global", "--uniform", "--out", "p"], "contradicts"),
    (["prune", "--model", "{llama}", *M, *DATA, "--method", "random", "--iterative", "2", "--out", "p"], "--iterative"),
    # sweep
    (["sweep", "--model", "{llama}", *M, *DATA, "--fractions", "0,2", "--out", "w"], "2"),
    (["sweep", "--model", "{llama}", *M, *DATA, "--orders", "alphabetical", "--out", "w"], "alphabetical"),
    (["sweep", "--model", "{llama}", *M, *DATA, "--out", "{existing}"], "--overwrite"),
    (["sweep", "--model", "{llama}", *M, *DATA, "--seq-len", "999", "--out", "w"], "999"),
    (["sweep", "--model", "{llama}", *M, *DATA, "--orders", "obs,oracle", "--out", "w"], "oracle"),
    (["sweep", "--model", "{llama}", *M, *DATA, "--long-context", "96", "--out", "w"], "maximum positions (64)"),
    (["sweep", "--model", "{llama}", *M, *DATA, "--long-context", "2k,two", "--out", "w"], "cannot read '2k,two'"),
    # convert-gqa
    (["convert-gqa", "--model", "{mha}", *M, *DATA, "--kv-heads", "3", "--out", "c"], "3"),
    (["convert-gqa", "--model", "{gpt2}", *M, *DATA, "--kv-heads", "2", "--out", "c"], "gpt2"),
    # MLA (deepseek_v3): one latent for all heads, no KV heads to pool, expand or merge
    (["convert-gqa", "--model", "{mla}", *M, *DATA, "--kv-heads", "2", "--method", "svd", "--out", "c"], "latent"),
    (["convert-gqa", "--model", "{mla}", "--streaming", "--kv-heads", "2", "--out", "c"], "latent"),
    (["expand-kv", "--model", "{mla}", "--streaming", "--kv-heads", "8", "--out", "e"], "latent"),
    (["gqa-sweep", "--model", "{mla}", *M, *DATA], "latent"),
    (["convert-gqa", "--model", "{mha}", *M, *DATA, "--kv-heads", "2", "--out", "{existing}"], "--overwrite"),
    (["convert-gqa", *NO_MODEL, *DATA, "--kv-heads", "2", "--out", "c"], "{missing}"),
    (["convert-gqa", "--model", "{mha}", "--streaming", "--kv-heads", "2", "--method", "svd", "--out", "c"], "mean"),
    (["convert-gqa", "--model", "org/name", "--streaming", "--kv-heads", "2", "--out", "c"], "local checkpoint"),
    (["convert-gqa", "--model", "{mha}", "--streaming", "--kv-heads", "3", "--out", "c"], "3"),
    (
        ["convert-gqa", "--model", "{mha}", "--streaming", "--kv-heads", "2", "--dtype", "bfloat16", "--out", "c"],
        "dtype",
    ),
    (["convert-gqa", "--model", "{mha}", "--streaming", "--kv-heads", "2", "--max-shard-size", "0", "--out", "c"], "1"),
    # convert-mla
    # convert-mla --streaming: the rope-dim search runs whole models; recovery trains one (tests/test_mla_streaming.py)
    (["convert-mla", "--model", "{llama}", *M, *DATA, "--streaming", "--budget", "mqa", "--out", "c"], "--rope-dim"),
    (
        [
            "convert-mla",
            "--model",
            "{llama}",
            *M,
            *DATA,
            "--streaming",
            "--kv-lora-rank",
            "24",
            "--rope-dim",
            "8",
            "--recover",
            "local",
            "--out",
            "c",
        ],
        "--streaming",
    ),
    (["convert-mla", "--model", "org/name", "--streaming", "--budget", "gqa", "--out", "c"], "local checkpoint"),
    (
        ["convert-mla", "--model", "{llama}", *M, *DATA, "--kv-lora-rank", "60", "--rope-dim", "8", "--out", "c"],
        "full rank",
    ),
    (
        ["convert-mla", "--model", "{llama}", *M, *DATA, "--kv-lora-rank", "8", "--rope-dim", "6", "--out", "c"],
        "divisor",
    ),
    (
        ["convert-mla", "--model", "{llama}", *M, *DATA, "--kv-lora-rank", "0", "--rope-dim", "16", "--out", "c"],
        "no room",
    ),
    (["convert-mla", "--model", "{llama}", *M, *DATA, "--out", "c"], "--budget"),
    (["convert-mla", "--model", "{llama}", *M, *DATA, "--budget", "half", "--out", "c"], "unknown budget"),
    (["convert-mla", "--model", "{llama}", *M, *DATA, "--budget", "150%", "--out", "c"], "above the source"),
    (["convert-mla", "--model", "{llama}", *M, *DATA, "--budget", "65", "--out", "c"], "above the source's own cache"),
    (["convert-mla", "--model", "{llama}", *M, *DATA, "--budget", "2", "--out", "c"], "no room for a latent"),
    (
        [
            "convert-mla",
            "--model",
            "{llama}",
            "--device",
            "cpu",
            "--dtype",
            "float16",
            *DATA,
            "--budget",
            "mqa",
            "--out",
            "c",
        ],
        "float16",
    ),
    (["convert-mla", "--model", "{gpt2}", *M, *DATA, "--budget", "gqa", "--out", "c"], "gpt2"),
    (["convert-mla", "--model", "{llama}", *M, *DATA, "--budget", "gqa", "--out", "{existing}"], "--overwrite"),
    (["convert-mla", *NO_MODEL, *DATA, "--budget", "gqa", "--out", "c"], "{missing}"),
    (["convert-mla", "--model", "{olmo2}", *M, *DATA, "--streaming", "--budget", "gqa", "--out", "c"], "--streaming"),
    # expand-kv
    (["expand-kv", "--model", "{mha}", *M, *DATA, "--kv-heads", "4", "--out", "e"], "4"),
    (["expand-kv", "--model", "{gpt2}", *M, *DATA, "--kv-heads", "4", "--out", "e"], "gpt2"),
    (["expand-kv", "--model", "{llama}", *M, *DATA, "--kv-heads", "3", "--out", "e"], "3"),
    (["expand-kv", "--model", "{llama}", *M, *DATA, "--kv-heads", "4", "--out", "{existing}"], "--overwrite"),
    (["expand-kv", "--model", "{llama}", "--streaming", "--kv-heads", "3", "--out", "e"], "3"),
    (["expand-kv", "--model", "{gpt2}", "--streaming", "--out", "e"], "gpt2"),
    (["eval", "--model", "{llama}", "--max-memory", "1GB"], "--device-map auto"),
    (["eval", "--model", "{llama}", "--device-map", "auto", "--max-memory", "lots"], "--max-memory"),
    # prune --streaming never runs the model: heads by name or by a score table only (tests/test_prune_streaming.py)
    (["prune", "--model", "{llama}", "--streaming", "--out", "p"], "cannot score heads"),
    (
        ["prune", "--model", "{llama}", "--streaming", "--heads", "0:0", "--compensate", "ridge", "--out", "p"],
        "--streaming",
    ),
    (["prune", "--model", "{llama}", "--streaming", "--heads", "0:0", "--dtype", "bfloat16", "--out", "p"], "--dtype"),
    (["prune", "--model", "org/name", "--streaming", "--heads", "0:0", "--out", "p"], "local checkpoint"),
    (["prune", "--model", "{llama}", "--streaming", "--heads", "0:9", "--out", "p"], "9"),
    # recovery (--recover on convert-gqa and prune, uptrain --student/--teacher)
    (["uptrain", "--student", "{llama}", "--teacher", "{gpt2}", *M, *DATA, *EVAL32, "--steps", "1"], "not derived"),
    (["uptrain", "--student", "{othertok}", "--teacher", "{llama}", *M, *DATA, *EVAL32, "--steps", "1"], "tokenizers"),
    (["uptrain", "--student", "{llama}", "--teacher", "{mha}", *M, *DATA, "--lr", "-1e-4"], "--lr"),
    (["uptrain", "--student", "{llama}", "--teacher", "{mha}", *M, *DATA, "--minutes", "0"], "--minutes"),
    (["uptrain", "--student", "{llama}", "--teacher", "{mha}", *M, *DATA, "--steps", "99999999999"], "--steps"),
    (["uptrain", "--student", "{llama}", "--teacher", "{mha}", *M, *DATA, "--objective", "mse"], "mse"),
    (["uptrain", "--student", "{llama}", "--teacher", "{mha}", *M, *DATA, "--long-batch-size", "0"], "--long-batch-size"),
    (["uptrain", "--student", "{llama}", "--teacher", "{mha}", *M, *DATA, "--recover", "local,global"], "global"),
    # FSDP2 shards over torchrun's processes: without torchrun it is refused, not ignored (tests/test_uptrain_fsdp.py)
    (["uptrain", "--student", "{llama}", "--teacher", "{mha}", *M, *DATA, "--parallel", "fsdp"], "torchrun"),
    (
        [
            "prune",
            "--model",
            "{llama}",
            *M,
            *DATA,
            "--heads",
            "0:0",
            "--recover",
            "uptrain",
            "--recover-parallel",
            "fsdp",
        ],
        "--recover-parallel fsdp shards over torchrun",
    ),
    (
        [
            "convert-gqa",
            "--model",
            "{mha}",
            *M,
            *DATA,
            "--kv-heads",
            "2",
            "--recover",
            "uptrain",
            "--recover-minutes",
            "0",
        ],
        "--recover-minutes",
    ),
    (["convert-gqa", "--model", "{mha}", *M, *DATA, "--kv-heads", "2", "--recover", "everything"], "everything"),
    (["convert-gqa", "--model", "{mha}", *M, "--kv-heads", "2", "--streaming", "--recover", "local"], "--streaming"),
    (
        ["prune", "--model", "{llama}", *M, *DATA, "--heads", "0:0", "--recover", "uptrain", "--recover-lr", "0"],
        "--recover-lr",
    ),
    (
        ["prune", "--model", "{llama}", *M, *DATA, "--heads", "0:0", "--recover", "local", "--recover-minutes", "-3"],
        "--recover-minutes",
    ),
    (  # a share of the batch that rounds to no window: the error names the option, not the config field
        ["convert-gqa", "--model", "{mha}", *M, *DATA, "--kv-heads", "2", "--recover", "uptrain",
         "--recover-generated", "0.1"],
        "--recover-generated 0.1 of a batch",
    ),  # fmt: skip
    # gqa-sweep
    (["gqa-sweep", "--model", "{gpt2}", *M, *DATA], "gpt2"),
    (["gqa-sweep", "--model", "{mha}", *M, *DATA, "--kv-heads", "3"], "3"),
    (["gqa-sweep", "--model", "{mha}", *M, *DATA, "--out", "{existing}"], "--overwrite"),
    (["gqa-sweep", "--model", "{mha}", *M, *DATA, "--pool", "median"], "median"),
    (["gqa-sweep", "--model", "{mha}", *M, *DATA, "--grouping", "contiguous,random"], "random"),
    (["gqa-sweep", "--model", "{mha}", *M, *DATA, "--method", "mean,pca"], "pca"),
    (["gqa-sweep", "--model", "{mha}", *M, *DATA, "--kv-heads", "0"], "at least 1"),
    (["gqa-sweep", "--model", "{mha}", *M, *DATA, "--long-context", "96"], "maximum positions (64)"),
    (["gqa-sweep", "--model", "{mha}", *M, *DATA, "--long-context", "1,,x"], "cannot read '1,,x'"),
    (["convert-gqa", "--model", "{mha}", *M, *DATA, "--kv-heads", "0", "--out", "c"], "at least 1"),
    # uptrain
    (
        ["uptrain", "--model", "{llama}", "--teacher", "{mha}", *M, *DATA, "--eval-seq-len", "32", "--steps", "-1"],
        "--steps",
    ),
    (["uptrain", "--model", "{llama}", "--teacher", "{mha}", *M, *DATA, "--lr", "0"], "--lr"),
    (["uptrain", *NO_MODEL, "--teacher", "{mha}", *DATA, "--steps", "1"], "{missing}"),
    (
        [
            "uptrain",
            "--model",
            "{llama}",
            "--teacher",
            "{mha}",
            *M,
            *DATA,
            "--eval-seq-len",
            "32",
            "--steps",
            "1",
            "--out",
            "{existing}",
        ],
        "--overwrite",
    ),
    (
        [
            "uptrain",
            "--model",
            "{llama}",
            "--teacher",
            "{mha}",
            *M,
            *DATA,
            "--eval-seq-len",
            "32",
            "--steps",
            "1",
            "--seq-len",
            "900",
        ],
        "900",
    ),
    # export-gguf
    (["export-gguf", "--model", "{gpt2}", *M, "--no-verify", "--out", "g.gguf"], "llama family"),
    (["export-gguf", "--model", "{llama}", *M, "--no-verify", "--out", "g.gguf"], "byte-level BPE"),
    (["export-gguf", "--model", "{mlamoe}", *M, "--no-verify", "--out", "g.gguf"], "MoE layers"),
    (["export-gguf", "--model", "{llama}", *M, "--no-verify", "--out", "{existing}"], "--overwrite"),
    (["export-gguf", "--model", "{llama}", *M, "--outtype", "q9_z", "--out", "g.gguf"], "q9_z"),
    (["export-gguf", *NO_MODEL, "--no-verify", "--out", "g.gguf"], "{missing}"),
    (["export-gguf", "--model", "{llama}", *M, "--outtype", "iq2_xxs", "--out", "g.gguf"], "add --imatrix"),
    (["export-gguf", "--model", "{llama}", *M, "--outtype", "q8_0", "--imatrix", "--out", "g.gguf"], "drop --imatrix"),
    (["export-gguf", "--model", "{llama}", *M, "--outtype", "q4_1", "--gptq", "--out", "g.gguf"], "drop --gptq"),
    (["export-gguf", "--model", "{llama}", *M, "--smooth", "--smooth-alpha", "1.5", "--out", "g.gguf"], "--smooth-alpha"),
    (["export-gguf", "--model", "{llama}", *M, "--smooth", "--smooth-alpha", "x", "--out", "g.gguf"], "--smooth-alpha"),
    (["export-gguf", "--model", "{llama}", *M, "--smooth", "--smooth-alpha", "auto", "--out", "g.gguf"], "not f16"),
    # speed
    (["speed", "{llama}", "--device", "cpu", "--contexts", "100", "--runtime", "transformers"], "maximum positions"),
    (["speed", "{llama}", "--device", "cpu", "--contexts", "16", "--out", "{existing}"], "--overwrite"),
    (["speed", "{llama}", "--device", "cpu", "--contexts", "0"], "--contexts"),
    (["speed", "{llama}", "--device", "cpu", "--kv-cache", "fp8", "--kv-policy", "{emptydir}"], "--kv-cache"),
    (["speed", "{llama}", "--device", "cpu", "--contexts", "16", "--kv-policy", "{emptydir}"], "kv-policy run"),
    # plot
    (["plot", "{emptydir}"], "{emptydir}"),
    (["plot", "{missing}"], "{missing}"),
    (["plot", "{existing}"], "{existing}"),
    # report
    (["report", *NO_MODEL, *TEXT, "--quick", "--out", "r"], "{missing}"),
    (["report", "--model", "{llama}", *M, *TEXT, "--quick", "--out", "{existing}"], "--overwrite"),
    (["report", "--model", "{llama}", "--device", "tpu", *TEXT, "--quick", "--out", "r"], "tpu"),
    (
        ["report", "--model", "{llama}", *M, *TEXT, "--quick", "--orders", "obs,alphabetical", "--out", "r"],
        "alphabetical",
    ),
    # demo
    (["demo", *NO_MODEL, *TEXT, "--quick", "--out", "d"], "{missing}"),
    (["demo", "--model", "{llama}", *M, *TEXT, "--quick", "--out", "{existing}"], "--overwrite"),
    (["demo", "--model", "{llama}", "--device", "cuda", *TEXT, "--quick", "--out", "d"], "cuda"),
    # ---- issue 19: outputs that are, contain or lie inside an input (symlinks resolved), with --overwrite ----
    (["stats", "--model", "{llama}", *M, *DATA, "--out", "{llama}", "--overwrite"], "is the model"),
    (["stats", "--model", "{llama}", *M, *DATA, "--out", "{llamalink}", "--overwrite"], "is the model"),
    (["stats", "--model", "{llamalink}", *M, *DATA, "--out", "{llama}/stats"], "lies inside the model"),
    (["stats", "--model", "{nested}", *M, *DATA, "--out", "{nestparent}", "--overwrite"], "contains the model"),
    (["stats", "--model", "{llama}", *M, *DATA, "--out", "{text}", "--overwrite"], "is the corpus"),
    (["stats", "--model", "{llama}", *M, *DATA, "--out", "{text}/x"], "lies inside the corpus"),
    (["stats", "--model", "{llama}", *M, *DATA, "--out", ".", "--overwrite"], "working directory"),
    (["stats", "--model", "{llama}", *M, *DATA, "--out", "..", "--overwrite"], "working directory"),
    (["importance", "--model", "{llama}", *M, *DATA, "--out", "{llama}", "--overwrite"], "is the model"),
    (
        ["importance", "--model", "{llama}", *M, *DATA, "--mask", "{goodmask}", "--out", "{goodmask}", "--overwrite"],
        "is the table",
    ),
    (["sweep", "--model", "{llama}", *M, *DATA, "--out", "{llama}", "--overwrite"], "is the model"),
    (["gqa-sweep", "--model", "{mha}", *M, *DATA, "--out", "{mha}", "--overwrite"], "is the model"),
    (["prune", "--model", "{llama}", *M, *DATA, "--heads", "0:0", "--out", "{llama}", "--overwrite"], "is the model"),
    (
        [
            "prune",
            "--model",
            "{llama}",
            *M,
            *DATA,
            "--scores",
            "{foreign}",
            "--fraction",
            "0.25",
            "--out",
            "{foreign}",
            "--overwrite",
        ],
        "is the table",
    ),
    (
        ["convert-gqa", "--model", "{mha}", *M, *DATA, "--kv-heads", "2", "--out", "{mhalink}", "--overwrite"],
        "is the model",
    ),
    (["convert-gqa", "--model", "{mha}", "--streaming", "--kv-heads", "2", "--out", "{mha}/x"], "lies inside"),
    (["expand-kv", "--model", "{llama}", *M, *DATA, "--out", "{text}", "--overwrite"], "is the corpus"),
    (
        ["uptrain", "--model", "{llama}", "--teacher", "{mha}", *M, *DATA, "--out", "{mha}", "--overwrite"],
        "is the teacher",
    ),
    (["report", "--model", "{nested}", *M, *TEXT, "--quick", "--out", "{nestparent}", "--overwrite"], "contains"),
    (["demo", "--model", "{llama}", *M, *TEXT, "--quick", "--out", "{text}", "--overwrite"], "is the corpus"),
    (["plot", "{infrun}", "--out", "{infrun}"], "contains the table"),
    # ---- issue 29: a model whose files are links (the hub cache's layout), and commands that lacked the guard ----
    (["stats", "--model", "{snapshot}", *M, *DATA, "--out", "{blobs}", "--overwrite"], "(through the link to"),
    (["prune", "--model", "{snapshot}", *M, *DATA, "--heads", "0:0", "--out", "{blobs}", "--overwrite"], "contains"),
    (
        ["export-gguf", "--model", "{snapshot}", *M, "--out", "{snapshot}/x.gguf", "--no-verify"],
        "lies inside the model",
    ),
    (["export-gguf", "--model", "{llama}", *M, "--out", "{llama}/model.safetensors", "--overwrite"], "lies inside"),
    (["export-gguf", "--model", "{llama}", *M, *DATA, "--out", "{text}", "--overwrite"], "is the corpus"),
    (["speed", "{llama}", "--device", "cpu", "--out", "{llama}", "--overwrite"], "is the model"),
    (["speed", "{snapshot}", "--device", "cpu", "--out", "{snapshot}/run"], "lies inside the model"),
    # a KV-cache policy run is an input too: never replaced by the run that reads it
    (["speed", "{llama}", "--device", "cpu", *ONTO_POLICY], "--kv-policy"),
    (["longeval", "--model", "{llama}", *M, *TEXT, *ONTO_POLICY], "--kv-policy"),
    # ---- issue 19: outputs that cannot be written, checked before any work ----
    (["stats", "--model", "{llama}", *M, *DATA, "--out", "{badmask}/x"], "not a directory"),
    # ---- issue 19: validation of what is loaded ----
    (["info", "--model", "{kvnotdividing}", *M], "num_key_value_heads"),
    (["info", "--model", "{zeroheads}", *M], "num_attention_heads"),
    (["info", "--model", "{zerolayers}", *M], "num_hidden_layers"),
    (["info", "--model", "{hiddennotdividing}", *M], "hidden_size"),
    (["eval", "--model", "{kvnotdividing}", *M, *DATA], "num_key_value_heads"),
    (
        ["convert-gqa", "--model", "{kvnotdividing}", "--streaming", "--kv-heads", "1", "--out", "c"],
        "num_key_value_heads",
    ),
    (["info", "--model", "{truncated}", *M], "model.safetensors"),
    (["info", "--model", "{emptyweights}", *M], "empty"),
    (["info", "--model", "{badheader}", *M], "header"),
    (["convert-gqa", "--model", "{truncated}", "--streaming", "--kv-heads", "1", "--out", "c"], "model.safetensors"),
    (["info", "--model", "{unsafepickle}", *M], "pytorch_model.bin"),
    (["info", "--model", "{nanweight}", *M], "model.layers.1.mlp.up_proj.weight"),
    (["info", "--model", "{missingweight}", *M], "model.layers.0.self_attn.q_proj.weight"),
    (["info", "--model", "{layout_count}", *M], "num_heads"),
    (["info", "--model", "{layout_range}", *M], "outside"),
    (["info", "--model", "{layout_duplicate}", *M], "more than once"),
    (["info", "--model", "{layout_layers}", *M], "layers"),
    (
        ["prune", "--model", "{llama}", *M, *DATA, "--scores", "{foreign}", "--fraction", "0.25", "--out", "p"],
        "--allow-foreign-scores",
    ),
    (
        ["importance", "--model", "{llama}", *M, *DATA, "--mask", "{foreignmask}", "--out", "i"],
        "--allow-foreign-scores",
    ),
    (
        ["prune", "--model", "{llama}", *M, *DATA, "--scores", "{duplicates}", "--fraction", "0.25", "--out", "p"],
        "more than once",
    ),
    (["eval", "--model", "{llama}", *M, "--data", "{numbercells}", "--seq-len", "32"], "line 2"),
    (["eval", "--model", "{llama}", *M, "--data", "{listcells}", "--seq-len", "32"], "line 2"),
    (["eval", "--model", "{llama}", *M, "--data", "{fifo}", "--seq-len", "32"], "not a regular file"),
    (["plot", "{infrun}"], "no finite value"),
    # ---- issue 29: configs that contradict the tensors, names transformers does not know, tokenizers ----
    (["info", "--model", "{fewerlayers}", *M], "config field num_hidden_layers = 1 builds 1"),
    (["eval", "--model", "{morelayers}", *M, *DATA], "the checkpoint has no model.layers.2"),
    (["info", "--model", "{wrongshape}", *M], "intermediate_size = 96"),
    (["info", "--model", "{unknownact}", *M], "hidden_act = 'swishy'"),
    (["info", "--model", "{unknownrope}", *M], "rope_parameters.rope_type = 'wobbly'"),
    (["eval", "--model", "{bigtokenizer}", *M, *DATA], "token id"),
    (["info", "--model", "{brokentokenizer}", *M], "tokenizer.json"),
    # ---- issue 29: text that is not text, plot's tables, misleading messages ----
    (["eval", "--model", "{llama}", *M, "--data", "{randombytes}", "--seq-len", "32"], "not UTF-8 text"),
    (["eval", "--model", "{llama}", *M, "--data", "{controlchars}", "--seq-len", "32"], "is not text"),
    (["plot", "{headeronly}"], "no rows"),
    (["plot", "{textcolumn}"], "column 'importance' holds 'a' (line 2), not a number"),
    (["plot", "{figuresfile}"], "is a file, not a folder"),
    (["plot", "{duprun}"], "layer 0 head 1 more than once"),
    (["plot", "{fifo}"], "not a regular file or folder"),
    (["info", "--model", "{uppergguf}", *M], "GGUF"),
    (["info", "--model", "{fifo}", *M], "not a regular file or folder"),
    (["importance", "--model", "{llama}", *M, *DATA, "--mask", "{fifo}", "--out", "i"], "not a regular file or folder"),
    (["info", "--model", "{llama}/model.safetensors", *M], "not a .gguf"),
    (
        ["prune", "--model", "{llama}", *M, *DATA, "--scores", "{fifo}", "--fraction", "0.25", "--out", "p"],
        "not a regular file or folder",
    ),
    (
        ["sweep", "--model", "{llama}", *M, *DATA, "--fractions", "0.99", "--orders", "random", "--out", "w"],
        "pass --allow-empty-layer",
    ),
    # kv-policy (the tiny llama has 64 positions)
    (["kv-policy", *NO_MODEL, *DATA, "--out", "p"], "{missing}"),
    (["kv-policy", "--model", "{llama}", *M, *DATA, "--context", "128", "--out", "p"], "maximum positions"),
    (["kv-policy", "--model", "{llama}", *M, *DATA, "--context", "64", "--budget", "0.01", "--out", "p"], "below"),
    (["kv-policy", "--model", "{llama}", *M, *DATA, "--context", "64", "--evaluate", "1k", "--out", "p"], "1024"),
    (["kv-policy", "--model", "{llama}", *M, *DATA, "--stats", "{emptydir}", "--out", "p"], "stats_wide.csv"),
    (["kv-policy", "--model", "{bert}", *M, *DATA, "--out", "p"], "encoder"),
    (["kv-policy", "--model", "{llama}", *M, *DATA, "--tasks", "needle", "--out", "p"], "needle"),
    (["kv-policy", "--model", "{llama}", *M, *DATA, "--out", "{existing}"], "--overwrite"),
    # attribute (the tiny models read characters: "é" is unknown, "ab" two tokens)
    (["attribute", "--model", "{llama}", *M], "--text"),
    (["attribute", "--model", "{llama}", *M, "--text", "abc", "--text-file", "{text}"], "not both"),
    (["attribute", "--model", "{llama}", *M, "--text-file", "{missing}"], "{missing}"),
    (["attribute", "--model", "{llama}", *M, "--text", ""], "text is empty"),
    (["attribute", "--model", "{llama}", *M, "--text", "abc", "--target", "\u00e9"], "does not know"),
    (["attribute", "--model", "{llama}", *M, "--text", "abc", "--target", "ab"], "2 tokens"),
    (["attribute", "--model", "{llama}", *M, "--clean", "abc"], "--corrupted"),
    (["attribute", "--model", "{llama}", *M, "--clean", "abc", "--corrupted", "abcd"], "equal lengths"),
    (["attribute", "--model", "{llama}", *M, "--text", "abc", "--answers", "a,b"], "--clean"),
    (["attribute", "--model", "{llama}", *M, "--clean", "abc", "--corrupted", "abd", "--answers", "a"], "two tokens"),
    (["attribute", "--model", "{bert}", *M, "--text", "abc"], "encoder"),
    (["attribute", *NO_MODEL, "--text", "abc"], "{missing}"),
    (["attribute", "--model", "{llama}", *M, "--text", "abc", "--out", "{existing}"], "--overwrite"),
    # show (the tiny llama: 2 layers of 4 heads, 64 positions)
    (["show", "--model", "{llama}", *M], "--text"),
    (["show", "--model", "{llama}", *M, "--text", "abc", "--text-file", "{text}"], "not both"),
    (["show", "--model", "{llama}", *M, "--text-file", "{missing}"], "{missing}"),
    (["show", "--model", "{llama}", *M, "--text", " "], "text is empty"),
    (["show", *NO_MODEL, "--text", "abc"], "{missing}"),
    (["show", "--model", "{llama}", *M, "--text", "abc", "--heads", "L0H1,head3"], "'head3' is not a head name"),
    (["show", "--model", "{llama}", *M, "--text", "abc", "--heads", "L2H0"], "attention layers L0 .. L1"),
    (["show", "--model", "{llama}", *M, "--text", "abc", "--heads", "L1H4"], "layer 1 has 4 heads"),
    (["show", "--model", "{llama}", *M, "--text", "abc", "--max-tokens", "65"], "--max-tokens 65 exceeds"),
    (["show", "--model", "{llama}", *M, "--text", "abc", "--top-k", "256"], "--top-k"),
    (["show", "--model", "{llama}", *M, "--text", "abc", "--chunk", "0"], "--chunk"),
    (["show", "--model", "{llama}", *M, "--text", "abc", "--out", "{existing}"], "--overwrite"),
]

# lm-eval tasks (the lmeval extra); without lm-eval every --tasks line says how to install it (tests/test_lm_eval.py).
TASKS = ["eval", "--model", "{llama}", *M, "--tasks"]
if importlib.util.find_spec("lm_eval") is not None:
    CASES += [
        ([*TASKS, "tiny_mcq", "--include-path", "{tasks}"], "close matches: tiny_mc"),
        ([*TASKS, "x", "--include-path", "{badyaml}"], "broken.yaml does not parse"),
        ([*TASKS, "tiny_mc", "--include-path", "{tasks}", "--max-length", "65"], "65"),
        ([*TASKS, "tiny_mc", "--include-path", "{missing}"], "not a directory"),
        ([*TASKS, ",", "--include-path", "{tasks}"], "--tasks is empty"),
        ([*TASKS, "tiny_mc", "--include-path", "{tasks}", "--out", "{existing}"], "--overwrite"),
        ([*TASKS, "tiny_mc", "--include-path", "{tasks}", *ONTO_POLICY], "--kv-policy"),
    ]


def _mixed_shards(root: Path) -> Path:
    """A sharded tiny llama whose shard holding the final norm was replaced by a shard of a 3-layer run that holds
    third-layer tensors: it lacks what the index puts there."""
    import shutil

    from models import tiny_model
    from tiny_text import tiny_tokenizer

    for layers, name in ((2, "mixedshards"), (3, "otherrun")):
        tiny_model("llama", num_hidden_layers=layers).save_pretrained(root / name, max_shard_size="40KB")
    tiny_tokenizer().save_pretrained(root / "mixedshards")
    ours, theirs = ((json.loads((root / name / "model.safetensors.index.json").read_text())["weight_map"])
                    for name in ("mixedshards", "otherrun"))  # fmt: skip
    shutil.copyfile(root / "otherrun" / theirs["model.layers.2.self_attn.q_proj.weight"],
                    root / "mixedshards" / ours["model.norm.weight"])  # fmt: skip
    return root / "mixedshards"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad_input")
    paths = {
        "llama": save_tiny("llama", root / "llama"),  # 4 query heads, 2 KV heads, 64 positions
        "mha": save_tiny("llama_mha", root / "mha"),
        "gpt2": save_tiny("gpt2", root / "gpt2"),
        "olmo2": save_tiny("olmo2", root / "olmo2"),  # post-norm blocks
        "bert": save_tiny("bert", root / "bert"),  # an encoder: no KV cache
        "mla": save_tiny("deepseek_v3", root / "mla"),  # multi-head latent attention, dense MLPs
        # MLA with a MoE MLP in block 1 (llama.cpp export takes dense-MLP MLA only)
        "mlamoe": save_tiny(
            "deepseek_v3", root / "mlamoe", first_k_dense_replace=1, num_experts_per_tok=2, n_group=1, topk_group=1
        ),
        "missing": root / "no-such-thing",
        "text": root / "sample.txt",
        "existing": root / "existing",
        "badmask": root / "mask.csv",
        "othertable": root / "other.csv",
        "emptydir": root / "empty",
        "tasks": root / "tasks",
        "badyaml": root / "badyaml",
        "othertok": save_tiny("llama", root / "othertok"),  # its tokenizer is replaced below
    }
    _other_vocabulary(paths["othertok"])
    paths["snapshot"], paths["blobs"] = _hub_cache_layout(paths["llama"], root / "hub")
    paths["text"].write_text(SAMPLE_TEXT)
    paths["existing"].mkdir()
    (paths["existing"] / "keep.txt").write_text("an earlier result")
    paths["badmask"].write_text("layer,head\n0,1\n")  # no gate column
    # An importance table of a 3-layer, 2-head model: does not match the tiny 2-layer, 4-head llama.
    pd.DataFrame([{"layer": layer, "head": head, "importance": 0.5} for layer in range(3) for head in range(2)]).to_csv(
        paths["othertable"], index=False
    )
    paths["emptydir"].mkdir()
    paths["tasks"].mkdir()
    (paths["tasks"] / "tiny_mc.jsonl").write_text('{"q": "Sky?", "choices": ["blue", "red"], "label": 0}\n')
    (paths["tasks"] / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {paths['tasks'] / 'tiny_mc.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: q\ndoc_to_target: label\ndoc_to_choice: choices\n"
    )
    paths["mixedshards"] = _mixed_shards(root)
    paths["badyaml"].mkdir()
    (paths["badyaml"] / "broken.yaml").write_text("task: [unclosed\n")
    (paths["emptydir"] / "notes.txt").write_text("no tables here")
    _hostile(paths, root)
    return {name: str(path) for name, path in paths.items()}


def _hostile(paths: dict, root: Path) -> None:
    """Issue 19's inputs: symlinks and nesting for the output guard, damaged checkpoints, contradicting layouts,
    foreign and duplicate score tables, non-text corpus cells, a FIFO, an all-inf run."""
    from headlab.pruning.prune import Selection, prune

    paths["llamalink"] = root / "llama-link"
    paths["llamalink"].symlink_to(paths["llama"], target_is_directory=True)
    paths["mhalink"] = root / "mha-link"
    paths["mhalink"].symlink_to(paths["mha"], target_is_directory=True)
    paths["nestparent"] = root / "project"
    paths["nested"] = save_tiny("llama", paths["nestparent"] / "model")
    paths["goodmask"] = root / "good-mask.csv"
    paths["goodmask"].write_text("layer,head,gate\n0,1,0\n")
    paths.update(hostile.damaged_checkpoints(Path(paths["llama"]), root))
    pruned = root / "pruned-mha"
    mha = load_model(str(paths["mha"]), device="cpu")
    prune(mha, selection=Selection(heads="0:0"), mode="physical", out=pruned, data=str(paths["text"]), seq_len=32,
          evaluate=False, progress=False)  # fmt: skip
    paths.update(hostile.layout_variants(pruned, root))
    paths["foreign"] = hostile.foreign_run(root)
    paths["foreignmask"] = paths["foreign"] / "mask.csv"
    paths["foreignmask"].write_text("layer,head,gate\n0,1,0\n")
    paths["duplicates"] = hostile.duplicate_scores(root)
    paths.update(hostile.corpora(root, SAMPLE_TEXT))
    paths["infrun"] = hostile.infinite_run(root)
    paths.update(hostile.plot_runs(root))
    paths["randombytes"] = root / "random.txt"
    paths["randombytes"].write_bytes(bytes(range(256)) * 16)
    paths["controlchars"] = root / "controls.txt"
    paths["controlchars"].write_text(SAMPLE_TEXT[:100] + "\x00\x1b" * 200)
    paths["uppergguf"] = root / "model.GGUF"
    paths["uppergguf"].write_bytes(b"not a gguf file")


def _hub_cache_layout(checkpoint: Path, cache: Path) -> tuple[Path, Path]:
    """A copy of `checkpoint` laid out as the Hugging Face hub cache lays out a model: every file of
    snapshots/<revision>/ a relative symlink to its content in blobs/<sha256>. Returns (snapshot, blobs)."""
    import hashlib
    import os

    repo = cache / "models--tiny--llama"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(Path(checkpoint).iterdir()):
        content = path.read_bytes()
        blob = blobs / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)
    return snapshot, blobs


def _other_vocabulary(directory: Path) -> None:
    """Replace a saved checkpoint's tokenizer by one with another vocabulary (characters at other ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, **{chr(c): c - 20 for c in range(32, 127)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>").save_pretrained(directory)


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(("args", "fragment"), CASES, ids=[f"{c[0][0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(args, fragment, inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # "cuda" must be unavailable even on a GPU machine
    args = [a.format(**inputs) for a in args]
    fragment = fragment.format(**inputs)
    inputs_root = Path(inputs["llama"]).parent
    before = (_listing(tmp_path), _listing(inputs_root))
    code, out, err = run_cli(args, capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert out == ""
    assert len(lines) == 1 and err.startswith("headlab"), err  # no progress bar started before the check
    assert "Traceback" not in err
    assert fragment in lines[0], lines[0]
    assert (_listing(tmp_path), _listing(inputs_root)) == before


# ---- fuzzing the score and mask readers -------------------------------------------------------------------------

FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def layers(inputs):
    return load_model(inputs["llama"], device="cpu").layers  # 2 layers x 4 heads


CELL = st.one_of(
    st.integers(-2, 5),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from(["", "x", "1.0", "nan", "inf", "-0", "2e0"]),
)


def _row(layer, head, value):
    return {"layer": layer, "head": head, "importance": value}


FULL = [(layer, head) for layer in range(2) for head in range(4)]
TABLES = st.one_of(
    # the right pairs, random values (valid whenever the values are finite numbers)
    st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=8, max_size=8).map(
        lambda values: [_row(a, b, v) for (a, b), v in zip(FULL, values)]
    ),
    # random rows: wrong, duplicate, out-of-range or non-integer cells
    st.lists(st.fixed_dictionaries({"layer": CELL, "head": CELL, "importance": CELL}), max_size=10),
    # the right table with a column renamed, dropped or added
    st.tuples(
        st.sampled_from(["drop-layer", "drop-importance", "rename-score", "extra", "floats"]), st.integers(0, 7)
    ).map(lambda edit: _edited(*edit)),
)


def _edited(kind, index):
    rows = [_row(a, b, 0.1 * i) for i, (a, b) in enumerate(FULL)]
    for row in rows:
        if kind == "drop-layer":
            del row["layer"]
        elif kind == "drop-importance":
            del row["importance"]
        elif kind == "rename-score":
            row["score"] = row.pop("importance")
        elif kind == "extra":
            row["kv_head"] = "?"
    if kind == "floats":
        rows[index]["head"] = rows[index]["head"] + 0.5
    return rows


def _expected_scores(rows):
    """The reference reading: exactly the model's 8 (layer, head) pairs, integer-valued, finite values; else None."""
    if not rows:
        return None
    column = "importance" if "importance" in rows[0] else "score" if "score" in rows[0] else None
    if column is None or "layer" not in rows[0] or "head" not in rows[0]:
        return None
    got, result = [], [[None] * 4 for _ in range(2)]
    for row in rows:
        try:
            layer, head, value = float(row["layer"]), float(row["head"]), float(row[column])
        except (TypeError, ValueError):
            return None
        if not (math.isfinite(layer) and math.isfinite(head) and layer.is_integer() and head.is_integer()):
            return None
        if not math.isfinite(value):
            return None
        got.append((int(layer), int(head)))
        if (int(layer), int(head)) in FULL:
            result[int(layer)][int(head)] = value
    if len(set(got)) != len(got) or set(got) != set(FULL):
        return None
    return result


def _check_one_line(error):
    assert "\n" not in str(error) and str(error).strip()


def _check_table(read, path, layers, rows, expected):
    """`read` takes the table in `path` exactly when the reference reading `expected` does, with the same values."""
    try:
        values = read(path, layers)
    except HeadlabError as error:
        _check_one_line(error)
        assert expected is None, (rows, str(error))
        event("rejected")
        return
    event("accepted")
    assert expected is not None, rows
    assert [v.tolist() for v in values] == expected


def _check_bytes(read, path, layers, content):
    """Arbitrary bytes: one-line refusal, or one finite value per head of each layer."""
    path.write_bytes(content)
    try:
        values = read(path, layers)
    except HeadlabError as error:
        _check_one_line(error)
        return
    assert [len(v) for v in values] == [4, 4] and all(torch.isfinite(v).all() for v in values)


@FUZZ
@given(rows=TABLES)
def test_fuzzed_score_tables(rows, layers, tmp_path_factory):
    path = tmp_path_factory.mktemp("scores") / "scores.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    rows = pd.read_csv(path).to_dict("records") if path.stat().st_size > 1 else []  # what the file really says
    _check_table(read_scores, path, layers, rows, _expected_scores(rows))


@FUZZ
@given(content=st.binary(max_size=300))
def test_fuzzed_score_bytes(content, layers, tmp_path_factory):
    _check_bytes(read_scores, tmp_path_factory.mktemp("scores") / "scores.csv", layers, content)


def _expected_gates(rows):
    """Reference mask reading: listed heads take their gate, the rest 1; any bad row -> None."""
    gates = [[1.0] * 4 for _ in range(2)]
    if rows and not {"layer", "head", "gate"} <= set(rows[0]):
        return None
    seen = set()
    for row in rows:
        try:
            layer, head, gate = float(row["layer"]), float(row["head"]), float(row["gate"])
        except (TypeError, ValueError):
            return None
        if not (math.isfinite(layer) and math.isfinite(head) and layer.is_integer() and head.is_integer()):
            return None
        layer, head = int(layer), int(head)
        if not (0 <= layer < 2 and 0 <= head < 4) or not math.isfinite(gate) or (layer, head) in seen:
            return None
        seen.add((layer, head))
        gates[layer][head] = float(torch.tensor(gate, dtype=torch.float32))
    return gates


MASKS = st.one_of(
    st.lists(st.fixed_dictionaries({"layer": CELL, "head": CELL, "gate": CELL}), min_size=1, max_size=10),
    st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3), st.floats(-2, 2, width=32)), min_size=1, max_size=8).map(
        lambda rows: [{"layer": a, "head": b, "gate": g} for a, b, g in rows]
    ),
    st.lists(st.fixed_dictionaries({"layer": CELL, "gate": CELL, "extra": CELL}), min_size=1, max_size=4),
)


@FUZZ
@given(rows=MASKS)
def test_fuzzed_mask_tables(rows, layers, tmp_path_factory):
    path = tmp_path_factory.mktemp("mask") / "mask.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    rows = pd.read_csv(path).to_dict("records")
    _check_table(read_mask, path, layers, rows, _expected_gates(rows))


@FUZZ
@given(content=st.binary(max_size=300))
def test_fuzzed_mask_bytes(content, layers, tmp_path_factory):
    _check_bytes(read_mask, tmp_path_factory.mktemp("mask") / "mask.csv", layers, content)


# ---- --seed determinism -----------------------------------------------------------------------------------------


def _run(args, capsys):
    code, _, err = run_cli(args, capsys)
    assert code == 0, err


def test_seed_makes_stats_and_importance_deterministic(inputs, tmp_path, capsys):
    base = ["--model", inputs["llama"], "--device", "cpu", "--data", inputs["text"], "--seq-len", "32"]
    stats = [*base, "--max-tokens", "128", "--induction-len", "8", "--induction-count", "2"]
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        _run(["stats", *stats, "--seed", str(seed), "--out", tmp_path / f"stats-{name}"], capsys)
    for table in ("stats.csv", "stats_wide.csv"):
        assert (tmp_path / "stats-a" / table).read_bytes() == (tmp_path / "stats-b" / table).read_bytes()
    induction = []
    for name in "ac":
        frame = pd.read_csv(tmp_path / f"stats-{name}" / "stats.csv")
        induction.append(frame[frame["statistic"] == "induction"]["value"].reset_index(drop=True))
    assert len(induction[0]) == 8 and not induction[0].equals(induction[1])  # another seed, other random tokens

    for name in ("a", "b"):
        _run(["importance", *base, "--max-tokens", "128", "--out", tmp_path / f"imp-{name}"], capsys)
    assert (tmp_path / "imp-a" / "importance.csv").read_bytes() == (tmp_path / "imp-b" / "importance.csv").read_bytes()


def test_seed_makes_random_sweep_deterministic(inputs, tmp_path, capsys):
    base = ["--model", inputs["llama"], "--device", "cpu", "--data", inputs["text"], "--seq-len", "32"]
    args = [*base, "--max-tokens", "64", "--orders", "random", "--fractions", "0.25,0.5", "--mode", "mask"]
    for name, seeds in (("a", "3"), ("b", "3"), ("c", "4")):
        _run(["sweep", *args, "--seeds", seeds, "--out", tmp_path / name], capsys)
    # Every column but the measured speed (tokens_per_s, wall-clock by nature) must match to the byte.
    a, b, c = (_untimed(pd.read_csv(tmp_path / n / "sweep.csv")) for n in "abc")
    assert a.to_csv(index=False) == b.to_csv(index=False)
    assert len(a) == 2 and set(a["order"]) == {"random"}
    assert not a.drop(columns="seed").equals(c.drop(columns="seed"))  # seed 4 prunes other heads than seed 3


def _untimed(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=[c for c in frame.columns if c.endswith("per_s") or "seconds" in c])
