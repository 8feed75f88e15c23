#!/usr/bin/env bash
# One short GPU check for a lent CUDA machine (about 15 minutes of device time): the cuda tests, the CLI on the
# embedded model, the 8B shape at 8 layers, FSDP2 uptraining with NCCL, and the stats/importance/eval benchmarks. Logs and benchmark results go to $OUT (or gpu-check/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
status=0
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember a failure, go on
    local name=$1
    shift
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    local start=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 5 "$OUT/$name.log"
    [ "$rc" -eq 0 ] || status=1
}
# torch is preinstalled with CUDA; nothing else is added. Without an index (an offline machine) fall back to what is
# already installed.
step install bash -c "python -m pip install -q -e '.[test]' || python -m pip install -q --no-deps --no-build-isolation -e ."
step env python -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name(0))"
step pytest python -m pytest -q -m cuda tests/test_cuda.py
step eval headlab eval --device cuda
step stats headlab stats --device cuda --max-tokens 4096 --out "$OUT/runs/stats" --overwrite
step importance headlab importance --device cuda --out "$OUT/runs/importance-grad" --overwrite
step device_map_eval headlab eval --device cuda --device-map auto --dtype bfloat16
step prune_bf16 headlab prune --device cuda --dtype bfloat16 --fraction 0.2 --mode physical --out "$OUT/runs/pruned" --overwrite
step convert_bf16 headlab convert-gqa --device cuda --dtype bfloat16 --kv-heads 1 --out "$OUT/runs/mqa" --overwrite
step streaming headlab convert-gqa --streaming --kv-heads 1 --out "$OUT/runs/mqa-streamed" --overwrite
# The Llama-3.1-8B shape at 8 layers (5.2 GiB of random bf16 weights, scripts/make_shape.py): in memory on the GPU,
# then spread over GPU, CPU and disk by --max-memory (docs/scaling.md).
SHAPE="$OUT/runs/llama8b-8layers"
step shape_8b python scripts/make_shape.py llama-3.1-8b --layers 8 --out "$SHAPE" --overwrite
step shape_8b_eval headlab eval --model "$SHAPE" --device cuda --dtype bfloat16 --max-tokens 2048 --domains none
step shape_8b_importance headlab importance --model "$SHAPE" --device cuda --dtype bfloat16 --max-tokens 2048 \
    --out "$OUT/runs/importance-8b" --overwrite
step shape_8b_convert headlab convert-gqa --model "$SHAPE" --device cuda --dtype bfloat16 --kv-heads 2 \
    --max-tokens 1024 --out "$OUT/runs/gqa2-8b" --overwrite
step shape_8b_offloaded headlab eval --model "$SHAPE" --device cuda --device-map auto --max-memory 2GiB \
    --max-tokens 512 --domains none
step shape_8b_prune_streaming headlab prune --streaming --model "$SHAPE" --scores "$OUT/runs/importance-8b" \
    --fraction 0.25 --uniform --mode physical --out "$OUT/runs/pruned-8b" --overwrite
rm -rf "$SHAPE" "$OUT/runs/gqa2-8b" "$OUT/runs/pruned-8b"  # 5 GB each: nothing to bring back
# FSDP2 uptraining on CUDA with NCCL (issue #34, item 3), under a minute: the MQA student of convert_bf16 towards the
# embedded model, 4 steps. Two processes where there are two GPUs; with one GPU a torchrun world of one (NCCL refuses
# two ranks on one device), which checks the FSDP path, the NCCL group and the gathered save, not the sharing.
NPROC=$(python -c "import torch; print(min(2, torch.cuda.device_count()))" 2>/dev/null || echo 1)
[ "$NPROC" -ge 1 ] || NPROC=1
echo "   uptrain_fsdp: --nproc-per-node $NPROC" | tee -a "$OUT/summary.txt"
step uptrain_fsdp timeout 120 python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m headlab uptrain \
    --student "$OUT/runs/mqa" --device cuda --parallel fsdp --steps 4 --seq-len 128 --batch-size "$((2 * NPROC))" \
    --heldout-tokens 512 --eval-tokens 0 --out "$OUT/runs/uptrain-fsdp" --overwrite
step uptrain_fsdp_bytes python -c "import json, sys; m = json.load(open(sys.argv[1]))['uptrain']; print(m['processes'], m['parallel'], m['bytes_per_process'])" "$OUT/runs/uptrain-fsdp/recovery/meta.json"
step benchmark python scripts/benchmark.py --case stats --case importance --case eval --device cuda --repeats 3
# Long context at 2k/4k/8k (issues #30 and #32: the rungs' needles and NLL by position, the KV policy against
# structural compression at equal bytes), at most 5 minutes each: what 2 CPU cores cannot afford (an 8k prompt is
# about 100 s there, well under a second here).
step long timeout 300 env HEADLAB_BENCH_LONG_LENGTHS=2048,4096,8192 python scripts/benchmark.py --case long --device cuda
step kv_policy timeout 300 env HEADLAB_BENCH_POLICY_LENGTHS=4096,8192 python scripts/benchmark.py --case kv_policy --device cuda
mkdir -p "$OUT/benchmarks"
cp -r benchmarks/results "$OUT/benchmarks/" 2>/dev/null
cp BENCHMARKS.md "$OUT/" 2>/dev/null
echo "overall: $([ $status -eq 0 ] && echo ok || echo FAILED)" | tee -a "$OUT/summary.txt"
exit $status
