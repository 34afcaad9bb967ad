#!/usr/bin/env bash
# Run ON the GPU machine (device tool, carry [".gpu"] made by scripts/gpu_prepare.sh), in the repo root.
# About 8 minutes on one H200. Writes its results under $OUT (or ./gpu-results when OUT is unset):
#   gpu-tests.log    the GPU-marked tests (tests/test_gpu.py)
#   bench.json       Llama-3.1-8B shape, random weights, bf16: full cache vs SnapKV at 16k and 128k
#   longest.json     the longest prompt that fits with budget 4096 (document-window tier)
set -uo pipefail
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 SNAPKV_HOME=/tmp/snapkv-home
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -s 2>&1 | tee "$OUT/gpu-tests.log"

SHAPE=samples/configs/llama-3.1-8b.json
timeout 240 python3 -m snapkv_cli bench --random-weights "$SHAPE" --tokenizer .gpu/tokenizer \
    --length 16k,128k --budget 1024,2048 --no-query-aware --decode-tokens 64 --repeats 3 --json \
    > "$OUT/bench.json" 2> "$OUT/bench.err"; echo "bench exit $?" | tee -a "$OUT/gpu.txt"

timeout 150 python3 benchmarks/prefill.py longest --random-weights "$SHAPE" --tokenizer .gpu/tokenizer \
    --budget 4096 --lengths 256k,512k,768k,1m > "$OUT/longest.json" 2> "$OUT/longest.err"
echo "longest exit $?" | tee -a "$OUT/gpu.txt"
