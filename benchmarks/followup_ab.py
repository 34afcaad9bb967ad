"""The follow-up (load + the question's pass + first token) of two snapkv checkouts, interleaved round by round.

A shared 2-core machine moves the same follow-up by 1.3-2x within minutes, so two runs of `snapkv bench` minutes apart
cannot tell a 10% change. Here two worker processes (this checkout and another, e.g. a `git worktree` of an earlier
commit) each load the model once, then answer the same saved cache in turn, one round each, their order swapped every
round; the per-round ratio is what to read. Both read the file the same way only where the older snapkv reads it
(a file this checkout writes carries fields older versions ignore).

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/followup_ab.py --other /tmp/base --tokens 8k --rounds 15

A cache of --tokens (the needle haystack, default settings, budget 1024) is prefilled and saved by this checkout
first, unless --file names one. --decode N answers N tokens each round instead of one, and compares the decode's
ms/token too (the same greedy tokens in both checkouts, unless an answer changed).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def worker(path: str, tokens: int) -> None:
    """In a worker process: the model loaded once, then one follow-up of `tokens` answer tokens per line read, its
    times printed: the whole, the load, the first token, the decode's ms/token (0 for one token)."""
    import time
    from dataclasses import replace

    import torch

    from snapkv.measure import bench
    from snapkv.compression.config import DEFAULTS
    from snapkv.engine.models import load_model
    from snapkv.session import Session

    torch.set_num_threads(2)
    loaded = load_model()
    session = Session(loaded, replace(DEFAULTS, budget=1024), allow_extrapolation=True)
    print("ready", flush=True)
    for _ in sys.stdin:
        started = time.perf_counter()
        prepared = session.load_file(Path(path), check_sources=False)
        answered = bench._answer(session, prepared, max_new_tokens=tokens, measure=False)
        total = time.perf_counter() - started
        decode = answered.decode_ms_per_token if tokens > 1 else 0.0
        print(f"{total:.4f} {prepared.load_seconds:.4f} {answered.ttft_seconds:.4f} {decode:.4f}", flush=True)


def saved_cache(tokens: str, folder: str) -> str:
    """A needle haystack of `tokens` prefilled with the default settings (budget 1024) and saved: its path."""
    from dataclasses import replace

    import torch

    from snapkv.measure.bench import NEEDLE_NUMBER
    from snapkv.compression.config import DEFAULTS
    from snapkv.io.documents import Document
    from snapkv.io.haystack import build_haystack, filler_text
    from snapkv.engine.models import load_model
    from snapkv.session import Session
    from snapkv.base.sizes import parse_size

    torch.set_num_threads(2)
    loaded = load_model()
    session = Session(loaded, replace(DEFAULTS, budget=1024), allow_extrapolation=True)
    length = parse_size(tokens)
    document = Document(build_haystack(loaded.tokenizer, filler_text(), length, 0.5, NEEDLE_NUMBER).text)
    prepared = session.prepare(session.prompt(document, max_tokens=length))
    path = os.path.join(folder, "followup.snapkv")
    session.save(prepared, Path(path))
    print(f"{prepared.tokens} tokens prefilled in {prepared.prefill_seconds:.1f} s and saved", flush=True)
    return path


def start(root: Path, path: str, tokens: int) -> subprocess.Popen:
    """A worker importing snapkv from `root` (its own checkout, not the one installed)."""
    environment = {**os.environ, "PYTHONPATH": str(root), "SNAPKV_FOLLOWUP_AB_ROOT": str(root)}
    process = subprocess.Popen([sys.executable, __file__, "--worker", path, "--decode", str(tokens)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=environment)
    if process.stdout.readline().strip() != "ready":
        raise SystemExit(f"the worker for {root} did not start")
    return process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", type=Path, help="the root of the other checkout")
    parser.add_argument("--tokens", default="8k")
    parser.add_argument("--file", help="a saved cache to answer (else one is made)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--decode", type=int, default=1, metavar="N", help="answer tokens each round (default 1)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        root = os.environ.get("SNAPKV_FOLLOWUP_AB_ROOT")
        if root:  # an editable install's finder would import the installed checkout before PYTHONPATH's
            sys.meta_path[:] = [finder for finder in sys.meta_path if "editable" not in type(finder).__name__.lower()
                                and "editable" not in getattr(finder, "__module__", "").lower()]
            sys.path.insert(0, root)
        worker(args.worker, max(1, args.decode))
        return
    if args.other is None:
        parser.error("--other is required")
    with tempfile.TemporaryDirectory() as folder:
        path = args.file or saved_cache(args.tokens, folder)
        tokens = max(1, args.decode)
        workers = {"this checkout": start(HERE, path, tokens),
                   f"other ({args.other})": start(args.other.resolve(), path, tokens)}
        times = {name: [] for name in workers}
        for round_index in range(args.rounds):
            order = list(workers.items())
            for name, process in order if round_index % 2 == 0 else reversed(order):
                process.stdin.write("go\n")
                process.stdin.flush()
                times[name].append([float(value) for value in process.stdout.readline().split()])
        for process in workers.values():
            process.stdin.close()
            process.wait()
    for name, rounds in times.items():
        total, load, first = (1000 * statistics.median(row[i] for row in rounds[1:]) for i in range(3))
        print(f"{name}: {total:.0f} ms (load {load:.0f} + first token {first:.0f}), medians of rounds 2-{len(rounds)}; "
              f"every round: {[round(1000 * row[0]) for row in rounds]}")
        if args.decode > 1:
            print(f"{name}: decode {statistics.median(row[3] for row in rounds[1:]):.2f} ms/token, median of rounds "
                  f"2-{len(rounds)}")
    mine, theirs = times.values()
    for label, column in (("follow-up", 0), ("decode", 3)) if args.decode > 1 else (("follow-up", 0),):
        ratios = [other[column] / own[column] for own, other in zip(mine, theirs)][1:]
        print(f"{label}, other / this checkout, per round: median {statistics.median(ratios):.2f}x "
              f"(rounds: {', '.join(f'{ratio:.2f}' for ratio in ratios)})")


if __name__ == "__main__":
    main()
