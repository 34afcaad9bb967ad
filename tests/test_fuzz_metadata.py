"""Crafted cache metadata: any value of any type at any key, with a recomputed checksum (anyone can write one).

Each file is opened by `snapkv info` and `snapkv ask` (the embedded model, two tokens) in a child process
under a memory and a time limit: the exit code is 0 or 5, with no traceback and no internal error. A few
examples run in the default suite; SNAPKV_FUZZ_EXAMPLES=500 runs a longer hunt.
"""

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("SNAPKV_FUZZ_EXAMPLES", "6"))
MEMORY_LIMIT = 6 * 2**30  # address space of the child: a model load needs ~3 GiB of it
TIME_LIMIT = 180          # seconds for both commands, on a busy 2-core machine

# The keys a reader uses, where a crafted value does the most harm; plus a new key anywhere.
PATHS = [
    ("original_length",), ("num_layers",), ("version",), ("mode",), ("document_span",), ("document_span", 0),
    ("sources",), ("created",), ("producer",), ("model",), ("model", "name"), ("model", "num_layers"),
    ("model", "head_dim"), ("tier",), ("tier", "bits"), ("tier", "cut"), ("tier", "truncation"),
    ("per_question",), ("per_question", "kernel"), ("per_question", "budget"), ("per_question", "window"),
    ("per_question", "method"), ("per_question", "pooling"), ("storage",), ("storage", "bits"),
    ("storage", "head_dim"), ("storage", "kv_heads"), ("storage", "dtype"), ("storage", "format"),
    ("storage", "values"), ("storage", "values", "group"), ("storage", "values", "bits"),
    ("storage", "values", "axis"), ("payload_sha256_lanes",), ("unknown",),
]

values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
              st.sampled_from([0, -1, 1, 2, 15, 4096, 2**31 - 1, 2**32 + 15, 10**8, 2**63]),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
              st.sampled_from(["16/8", "8", "4/3", "3/2+20%@8/4", "query-aware", "snapkv", "max", "tokens"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6)

CHILD = """
import sys
from snapkv_cli.app import run
path = sys.argv[1]
codes = [run(["info", path]), run(["ask", path, "What was the revenue?", "--max-new-tokens", "2", "--no-server", "-q"])]
print("@@codes", *codes)
"""


@pytest.fixture(scope="module")
def seed(embedded_home, tmp_path_factory):
    """A small real cache of the embedded model, in the default tier, and its tensors."""
    from safetensors.torch import load_file

    from snapkv.storage.cachefile import read_metadata
    from snapkv.compression.config import DEFAULTS
    from snapkv.io.documents import Document
    from snapkv.engine.models import load_model
    from snapkv.session import Session

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SNAPKV_HOME", str(embedded_home))
        session = Session(load_model(), DEFAULTS)
        prepared = session.prepare(Document("Revenue was 121.3 million pounds in 2022 and 184.6 in 2023. " * 4))
        path = tmp_path_factory.mktemp("fuzz-metadata") / "seed.snapkv"
        session.save(prepared, path)
    return read_metadata(path), load_file(str(path)), embedded_home


def crafted(metadata: dict, path: tuple, value) -> dict:
    """metadata with `value` put at `path` (the containers on the way made objects where they are not)."""
    data = json.loads(json.dumps(metadata))
    node = data
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if isinstance(node, dict):
        node[path[-1]] = value
    return data


def limit_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.slow
@pytest.mark.timeout(TIME_LIMIT * (EXAMPLES + 2))
@settings(deadline=None, max_examples=EXAMPLES, derandomize=EXAMPLES <= 20,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), value=values)
def test_crafted_metadata_is_used_or_refused_never_crashes(seed, tmp_path, path, value):
    from safetensors.torch import save_file

    from snapkv.storage.cachefile import payload_signatures

    metadata, tensors, home = seed
    data = crafted(metadata, path, value)
    data = {**data, **payload_signatures(tensors)}  # the checksum recomputed: it proves nothing
    file = tmp_path / "crafted.snapkv"
    save_file(tensors, str(file), metadata={"snapkv": json.dumps(data)})  # NaN and Infinity written as Python does
    env = {**os.environ, "SNAPKV_HOME": str(home), "SNAPKV_NOLOG": "1"}
    try:
        result = subprocess.run([sys.executable, "-c", CHILD, str(file)], capture_output=True, text=True, env=env,
                                timeout=TIME_LIMIT, preexec_fn=limit_child, cwd=Path(__file__).parent.parent)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{path} = {value!r}: still running after {TIME_LIMIT} s")
    codes = result.stdout.split("@@codes")[-1].split()
    assert result.returncode == 0 and len(codes) == 2, (path, value, result.stderr[-2000:])
    assert set(codes) <= {"0", "5"}, (path, value, codes, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, (path, value, result.stderr)
