"""Commands that run no model import neither torch nor transformers, so they answer at once."""

import json
import subprocess
import sys

import pytest

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
])
def test_commands_that_run_no_model_import_no_torch(tmp_path, argv, code):
    seen = imported_by(*argv, home=tmp_path)
    assert seen == {"code": code, "heavy": []}
