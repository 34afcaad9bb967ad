#!/usr/bin/env bash
# Run HERE (not on the GPU machine) before scripts/gpu_check.sh: puts into .gpu/ (ignored by git) what the
# GPU machine lacks and cannot download: wheels of snapkv's dependencies for its Python 3.12 (it has torch,
# accelerate, safetensors, tokenizers, rich; its transformers is older than the 5.24 snapkv needs) and the
# embedded model's tokenizer (the model's GGUF is too large to carry; random-weights runs need only this).
# Then call the device tool with carry [".gpu"] and command "bash scripts/gpu_check.sh".
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl transformers==5.24.0 typer==0.29.2 gguf pypdf platformdirs prompt_toolkit wcwidth cryptography
.venv/bin/python - <<'PY'
from transformers import AutoTokenizer
from snapkv.engine.models import resolve_model_source
AutoTokenizer.from_pretrained(resolve_model_source(None)[1]).save_pretrained(".gpu/tokenizer")
PY
du -sh .gpu
