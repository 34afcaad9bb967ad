"""Commands that run no model import neither torch nor transformers, so they answer at once."""

import json
import subprocess
import sys

import pytest

from conftest import VOCAB, build_tiny

# Runs the command in this process (as the console script does), then prints which heavy modules it imported.
PROBE = """
import json, sys
from snapkv_cli.app import run
code = run(sys.argv[1:])
print("@@", json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def imported_by(*argv, home) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120,
                            env={"SNAPKV_HOME": str(home), "PATH": "/usr/bin:/bin", "SNAPKV_NOLOG": "1"})
    return json.loads(result.stdout.split("@@")[-1])


@pytest.mark.parametrize("argv, code", [
    (["--version"], 0), (["--help"], 0), (["logs"], 0), (["logs", "path"], 0), (["cache", "list"], 0),
    (["cache", "list", "--json"], 0), (["models"], 0), (["serve", "--status"], 8), (["ask", "--help"], 0),
    (["ask", "missing.txt", "What?"], 4), (["ask", "missing.snapkv", "What?"], 5),
    (["ask", "README.md", "What?", "--budget", "0"], 2),
    (["compress", "missing.txt", "-o", "out.snapkv"], 4), (["repl", "missing.txt"], 4),
    (["repl", "missing.snapkv"], 5), (["cache"], 0), (["eval"], 0), (["ask", "-h"], 0),
])
def test_commands_that_run_no_model_import_no_torch(tmp_path, argv, code):
    seen = imported_by(*argv, home=tmp_path)
    assert seen == {"code": code, "heavy": []}


@pytest.fixture
def saved_cache(tmp_path):
    """A cache of a tiny model, saved with the document it was made from: (file, document)."""
    import torch

    from snapkv.storage.cachefile import save_cache
    from snapkv.compression.config import Cut
    from snapkv.io.documents import read_sources
    from snapkv.engine.generation import prefill

    document = tmp_path / "notes.txt"
    document.write_text("The vault code is 1234. " * 20)
    ids = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(0))
    cache = prefill(build_tiny("llama-gqa"), ids, Cut(24, 8)).at_precision("16/8")
    path = tmp_path / "notes.snapkv"
    save_cache(path, cache, sources=read_sources(str(document)).sources)
    return path, document


@pytest.mark.parametrize("argv, code", [
    (["info", "{file}"], 0), (["info", "{file}", "--json"], 0), (["info", "{file}", "{document}"], 0),
    (["info", "{file}", "{other}"], 5),
])
def test_info_reads_a_cache_without_torch(tmp_path, saved_cache, argv, code):
    path, document = saved_cache
    other = tmp_path / "other.txt"
    other.write_text("Something else entirely.")
    argv = [arg.format(file=path, document=document, other=other) for arg in argv]
    seen = imported_by(*argv, home=tmp_path / "home")
    assert seen == {"code": code, "heavy": []}
