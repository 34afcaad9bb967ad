"""A follow-up question from the shell, wall clock from process start to last byte, in one run:

1. as typed, with the defaults: the first `snapkv ask` on a document (imports, model load, prefill, stored
   tier, save; it leaves a server keeping the model loaded), then a second `snapkv ask` on it (runs on that
   server: a store hit with the model already loaded);
2. the same two with --no-server (SNAPKV_NO_SERVER=1): every ask a new process that loads the model.

Each ask is a real process, as a user types it (no options but --json, to read its parts); the embedded
model's conversion is done beforehand (it happens once per machine).

    .venv/bin/python benchmarks/followup_shell.py --tokens 7000
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "What is the special magic number?"


def timed_ask(document: Path, env: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "snapkv_cli", "ask", str(document), QUESTION, "--json"],
                            capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"ask failed: {result.stderr}")
    return seconds, json.loads(result.stdout)


def fresh_home(folder: Path, name: str, model: Path) -> Path:
    home = folder / name
    (home / "models").mkdir(parents=True)
    (home / "models" / model.name).symlink_to(model)
    return home


def show(name: str, seconds: float, report: dict, first: float) -> None:
    timings, answer = report["timings"], report["answers"][0]
    print(f"{name:<44}{seconds:7.2f} s  {first / seconds:6.1f}x  (model load {timings['model_load_seconds']:.2f} s, "
          f"prefill {timings['prefill_seconds']:.2f} s, cache load {report['cache']['load_seconds']:.2f} s, first "
          f"token {answer['ttft_seconds']:.2f} s, {answer['new_tokens']} tokens at "
          f"{answer['decode_tokens_per_second']:.1f}/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7000)
    args = parser.parse_args()
    from snapkv.io.haystack import build_haystack, filler_text
    from snapkv.engine.models import load_model, resolve_model_source

    model = Path(resolve_model_source(None)[1])  # converts the embedded model once, if it was not yet
    tokenizer = load_model().tokenizer
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        document = folder / "report.txt"
        document.write_text(build_haystack(tokenizer, filler_text(), args.tokens, 0.5, "58207").text)
        base = {k: v for k, v in os.environ.items() if k not in ("SNAPKV_NO_SERVER", "SNAPKV_KEEP_ALIVE")}
        typed = {**base, "SNAPKV_HOME": str(fresh_home(folder, "typed", model)), "SNAPKV_NOLOG": "1"}
        try:
            first, first_report = timed_ask(document, typed)
            second, second_report = timed_ask(document, typed)
        finally:
            subprocess.run([sys.executable, "-m", "snapkv_cli", "serve", "--stop"], env=typed, capture_output=True)
        local = {**typed, "SNAPKV_HOME": str(fresh_home(folder, "local", model)), "SNAPKV_NO_SERVER": "1"}
        local_first, local_first_report = timed_ask(document, local)
        local_hit, local_hit_report = timed_ask(document, local)
    reports = (first_report, second_report, local_first_report, local_hit_report)
    found = all("58207" in r["answers"][0]["answer"] for r in reports)
    same = len({r["answers"][0]["answer"] for r in reports}) == 1
    print(f"{first_report['document']['tokens']}-token document, {first_report['compression']['mode']}; needle "
          f"{'found' if found else 'MISSED'} in all four answers, which are {'identical' if same else 'NOT identical'}")
    print(f"{'':<44}{'wall':>9}  {'vs first':>7}")
    show("first ask, as typed (starts the server)", first, first_report, first)
    show("second ask, as typed (on that server)", second, second_report, first)
    show("first ask, --no-server", local_first, local_first_report, local_first)
    show("second ask, --no-server (store hit)", local_hit, local_hit_report, local_first)


if __name__ == "__main__":
    main()
