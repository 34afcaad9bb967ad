"""Two snapkv processes on the same cores against one alone, with the thread count fitted to the cores other processes
leave (the default, snapkv.native.threads) and fixed at one thread per core (SNAPKV_THREADS=N: what every process did
before), side by side in one run:

1. decode: `snapkv ask --no-server` on a saved document, alone, then two at once (decode tokens/s, first token);
2. prefill: `snapkv ask --no-server --no-store` (a prefill each time), alone, then while a second process answers
   questions on the saved document over and over (prefill seconds; the second process's decode tokens/s);
3. server: `snapkv serve --http` answering a saved document's question (a store hit), alone, then while an ask
   prefills (request seconds, first token).

Every ask is a real process with --json. The embedded model's conversion is done beforehand (once per machine).

    .venv/bin/python benchmarks/shared_cores.py
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from followup import running_server, timed

ROOT = Path(__file__).resolve().parent.parent
DOCUMENT = ROOT / "samples" / "city_transport_review.txt"
QUESTION = "Describe everything the document says about the authority's buses, trams and ticketing, in detail."


def ask(env: dict, *options: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "snapkv_cli", "ask", str(DOCUMENT), QUESTION, "--no-server",
                             "--json", *options], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"ask failed: {result.stderr}")
    return json.loads(result.stdout)


def decoded(report: dict) -> str:
    answer = report["answers"][0]
    return f"{answer['decode_tokens_per_second']:5.1f} tok/s, first token {answer['ttft_seconds']:.2f} s"


def at_once(*jobs) -> list:
    """Run the callables at the same time; their results in order."""
    results = [None] * len(jobs)

    def run(index, job):
        results[index] = job()
    threads = [threading.Thread(target=run, args=(index, job)) for index, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def decoding_until(stop: threading.Event, env: dict, tokens: str) -> list[dict]:
    reports = []
    while not stop.is_set():
        reports.append(ask(env, "--max-new-tokens", tokens))
    return reports


def prefill_beside_decodes(env: dict, tokens: str) -> tuple[dict, list[dict]]:
    stop = threading.Event()
    reports: list[dict] = []
    background = threading.Thread(target=lambda: reports.extend(decoding_until(stop, env, tokens)))
    background.start()
    try:
        prefilled = ask(env, "--no-store", "--max-new-tokens", "8")
    finally:
        stop.set()
        background.join()
    return prefilled, reports


def served_beside_a_prefill(env: dict, tokens: int) -> tuple[dict, dict]:
    """A server's answer to a saved document's question alone, then while an ask prefills beside it."""
    messages = [{"role": "user", "content": f"{DOCUMENT.read_text()}\n\n{QUESTION}"}]
    with running_server([sys.executable, "-m", "snapkv_cli", "serve"], env) as client:
        timed(client, "snapkv", messages, 8)  # the prefill, saved
        alone = timed(client, "snapkv", messages, tokens)
        prefilling = threading.Thread(target=ask, args=(env, "--no-store", "--max-new-tokens", "8"))
        prefilling.start()
        time.sleep(8)  # the ask's imports and model load done: its prefill is under way
        shared = timed(client, "snapkv", messages, tokens)
        prefilling.join()
    return alone, shared


def scenario(name: str, env: dict, tokens: str) -> None:
    print(f"\n## {name}")
    ask(env, "--max-new-tokens", "8")  # the document saved: the decode runs are store hits
    print(f"decode alone:          {decoded(ask(env, '--max-new-tokens', tokens))}")
    for index, report in enumerate(at_once(*[lambda: ask(env, "--max-new-tokens", tokens)] * 2), 1):
        print(f"decode, two at once #{index}: {decoded(report)}")
    alone = ask(env, "--no-store", "--max-new-tokens", "8")["timings"]["prefill_seconds"]
    print(f"prefill alone:         {alone:.1f} s")
    shared, beside = prefill_beside_decodes(env, tokens)
    rates = ", ".join(f"{report['answers'][0]['decode_tokens_per_second']:.0f}" for report in beside)
    print(f"prefill beside decodes: {shared['timings']['prefill_seconds']:.1f} s "
          f"({alone / shared['timings']['prefill_seconds']:.2f} of alone's speed); the decodes meanwhile: "
          f"{rates} tok/s")
    alone, shared = served_beside_a_prefill(env, int(tokens))
    print(f"server hit alone:       {alone['seconds']:.2f} s, first token {alone['ttft']:.2f} s")
    print(f"server hit beside a prefill: {shared['seconds']:.2f} s, first token {shared['ttft']:.2f} s "
          f"({alone['seconds'] / shared['seconds']:.2f} of alone's speed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="160", help="answer length of the decode runs")
    parser.add_argument("--models", type=Path, default=Path.home() / ".cache" / "snapkv" / "models",
                        help="the folder holding the converted embedded model (linked, not converted again)")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{cores} cores; document {DOCUMENT.name}")
    with tempfile.TemporaryDirectory() as folder:
        for name, threads in (("fitted to the free cores (default)", None), (f"fixed: SNAPKV_THREADS={cores}", cores)):
            home = Path(folder) / ("fitted" if threads is None else "fixed")
            home.mkdir()
            (home / "models").symlink_to(args.models)
            env = {**os.environ, "SNAPKV_HOME": str(home), "SNAPKV_KEEP_ALIVE": "0", "SNAPKV_NOLOG": "1"}
            env.pop("SNAPKV_THREADS", None)
            if threads is not None:
                env["SNAPKV_THREADS"] = str(threads)
            scenario(name, env, args.tokens)


if __name__ == "__main__":
    main()
