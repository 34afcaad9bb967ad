"""Prefill seconds of the full cache vs SnapKV, interleaved in one process so both see the same machine.

    .venv/bin/python benchmarks/prefill_overhead.py --tokens 7000 --budget 1024 --rounds 3
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from snapkv.config import SnapKVConfig
from snapkv.generation import prefill
from snapkv.haystack import build_haystack
from snapkv.models import load_model
from snapkv.prompting import context_ids

FILLER = Path(__file__).resolve().parent.parent / "samples" / "essays.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model()
    ids = context_ids(loaded.tokenizer, build_haystack(loaded.tokenizer, FILLER.read_text(), args.tokens, 0.5, "1").text)
    config = SnapKVConfig(budget=args.budget, query_aware=False)
    times: dict[str, list[float]] = {"full": [], "snapkv": []}
    prefill(loaded.model, ids[:512], None)  # warm-up
    for _ in range(args.rounds):
        for name, tier in (("full", None), ("snapkv", config)):
            started = time.perf_counter()
            prefill(loaded.model, ids, tier)
            times[name].append(time.perf_counter() - started)
    for name, values in times.items():
        print(f"{name:<8} {ids.shape[0]} tokens: median {statistics.median(values):.2f} s, "
              f"all {', '.join(f'{v:.2f}' for v in values)}")
    ratio = statistics.median(times["snapkv"]) / statistics.median(times["full"])
    per_round = [s / f for s, f in zip(times["snapkv"], times["full"])]
    print(f"prefill overhead: {ratio:.3f}x (per round: {', '.join(f'{r:.3f}' for r in per_round)})")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
