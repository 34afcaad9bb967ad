"""Prefill seconds of the full cache vs SnapKV, interleaved in one process so both see the same machine.

    .venv/bin/python benchmarks/prefill_overhead.py --tokens 7000 --budget 1024 --rounds 3
"""

import argparse
import statistics

import torch

from snapkv.compression.config import SnapKVConfig
from snapkv.io.documents import Document
from snapkv.io.haystack import build_haystack, filler_text
from snapkv.engine.models import load_model
from snapkv.session import Session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model()
    sessions = {"full": Session(loaded, None),
                "snapkv": Session(loaded, SnapKVConfig(budget=args.budget, query_aware=False))}
    document = Document(build_haystack(loaded.tokenizer, filler_text(), args.tokens, 0.5, "1").text)
    prompt = sessions["full"].prompt(document)
    sessions["full"].prepare(sessions["full"].prompt(document, max_tokens=512))  # warm-up
    times: dict[str, list[float]] = {"full": [], "snapkv": []}
    for _ in range(args.rounds):
        for name, session in sessions.items():
            times[name].append(session.prepare(prompt, measure=True).prefill_seconds)
    for name, values in times.items():
        print(f"{name:<8} {prompt.tokens} tokens: median {statistics.median(values):.2f} s, "
              f"all {', '.join(f'{v:.2f}' for v in values)}")
    ratio = statistics.median(times["snapkv"]) / statistics.median(times["full"])
    per_round = [s / f for s, f in zip(times["snapkv"], times["full"])]
    print(f"prefill overhead: {ratio:.3f}x (per round: {', '.join(f'{r:.3f}' for r in per_round)})")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
