"""A follow-up question from the shell, wall clock from process start to last byte, in one run:

1. the first `snapkv ask` on a document (a new process: imports, model load, prefill, stored tier, save);
2. a second `snapkv ask` on the same document in a new process (the saved cache is a store hit);
3. the same with `snapkv serve` running, so the model stays loaded between commands.

Each ask is a real process, as a user types it; the embedded model's conversion is done beforehand (it
happens once per machine). The parts of a cache-hit ask are printed from its --json report.

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
    result = subprocess.run([sys.executable, "-m", "snapkv_cli", "ask", str(document), QUESTION, "--answer-prefix",
                             "The special magic number is", "--max-new-tokens", "8", "--json"],
                            capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"ask failed: {result.stderr}")
    return seconds, json.loads(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7000)
    args = parser.parse_args()
    from snapkv.haystack import build_haystack, filler_text
    from snapkv.models import load_model, resolve_model_source

    source = Path(resolve_model_source(None)[1])  # converts the embedded model once, if it was not yet
    tokenizer = load_model().tokenizer
    with tempfile.TemporaryDirectory() as folder:
        home = Path(folder) / "home"
        (home / "models").mkdir(parents=True)
        (home / "models" / source.name).symlink_to(source)
        document = Path(folder) / "report.txt"
        document.write_text(build_haystack(tokenizer, filler_text(), args.tokens, 0.5, "58207").text)
        env = {**os.environ, "SNAPKV_HOME": str(home), "SNAPKV_NO_SERVER": "1", "SNAPKV_NOLOG": "1"}
        first, first_report = timed_ask(document, env)
        hit, hit_report = timed_ask(document, env)
        served_env = {k: v for k, v in env.items() if k != "SNAPKV_NO_SERVER"}
        subprocess.run([sys.executable, "-m", "snapkv_cli", "serve", "--detach", "--idle-timeout", "300"],
                       env=served_env, check=True, capture_output=True)
        try:
            timed_ask(document, served_env)  # the server's first request: it has the model, not yet the file
            served, served_report = timed_ask(document, served_env)
        finally:
            subprocess.run([sys.executable, "-m", "snapkv_cli", "serve", "--stop"], env=served_env,
                           capture_output=True)
    found = all("58207" in r["answers"][0]["answer"] for r in (first_report, hit_report, served_report))
    print(f"{first_report['document']['tokens']}-token document, {first_report['compression']['mode']}, "
          f"needle {'found' if found else 'MISSED'} in all three")
    print(f"first ask (prefill, new process)        {first:7.2f} s  "
          f"(model load {first_report['timings']['model_load_seconds']:.2f} s, prefill + tier "
          f"{first_report['timings']['prefill_seconds']:.2f} s)")
    for name, seconds, report in (("cache-hit ask, new process", hit, hit_report),
                                  ("cache-hit ask, snapkv serve running", served, served_report)):
        timings, answer = report["timings"], report["answers"][0]
        print(f"{name:<40}{seconds:7.2f} s  ({first / seconds:5.1f}x faster; model load "
              f"{timings['model_load_seconds']:.2f} s, cache load {report['cache']['load_seconds']:.2f} s, "
              f"first token {answer['ttft_seconds']:.2f} s, {answer['new_tokens']} tokens at "
              f"{answer['decode_tokens_per_second']:.1f}/s)")


if __name__ == "__main__":
    main()
