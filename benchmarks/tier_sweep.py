"""Which stored tier to save by default: the needle grid, many questions and the file bytes of each setting.

Every setting answers with query-aware SnapKV at --budget; they differ in what is saved: the whole prompt
or a share of it chosen by a method (reconstruction, snapkv's document window, pseudo-question, key-norm),
in 16, 8, 4 or 2 bits. Per document the full cache is prefilled once and the tiers are derived from it
(each method scores it once), so a sweep costs about one prefill per document plus the scoring. All of it
goes through snapkv.measure.evaluation (and so Session), as `snapkv eval` does.

    .venv/bin/python benchmarks/tier_sweep.py --lengths 2k,4k,7k --depths 10,30,50,70,90 --json sweep.json
"""

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from snapkv.compression.config import DEFAULTS
from snapkv.measure.evaluation import EvalSetting, many_questions, needle_grid
from snapkv.compression.methods import PSEUDO_QUESTIONS, PseudoQuestion
from snapkv.engine.models import load_model
from snapkv.base.sizes import parse_sizes

# named variants of a method with settings of its own, for --tiers
VARIANTS = {
    "tail": PseudoQuestion(questions=(), tail=32),
    "pq+tail": PseudoQuestion(tail=32),
    "pq2+tail": PseudoQuestion(questions=(*PSEUDO_QUESTIONS, "Summarize the document."), tail=32),
    "pq3+tail": PseudoQuestion(questions=(*PSEUDO_QUESTIONS, "Summarize the document.",
                                          "Who and what does the document name, and where?"), tail=32),
}

# (method, kept share, bits[, pooling kernel]); None for the whole prompt
TIERS = [(None, None, 16), (None, None, 8), (None, None, 4), (None, None, 2),
         ("reconstruction", 0.5, 16), ("reconstruction", 0.5, 8), ("reconstruction", 0.5, 4), ("reconstruction", 0.5, 2),
         ("reconstruction", 0.33, 4), ("reconstruction", 0.25, 4), ("reconstruction", 0.15, 4),
         ("snapkv", 0.5, 4), ("pseudo-question", 0.5, 4), ("key-norm", 0.5, 4)]


def settings(budget: int, tiers: list) -> list[EvalSetting]:
    found = [EvalSetting("full", None)]
    for method, keep, bits, *kernel in tiers:
        config = replace(DEFAULTS, budget=budget, store_keep=keep,
                         store_method=VARIANTS.get(method, method or DEFAULTS.store_method),
                         store_bits=bits, store_kernel=kernel[0] if kernel else None)
        setting = EvalSetting.named(config)
        suffix = (f" [{method}]" if method in VARIANTS else "") + (f" k{kernel[0]}" if kernel else "")
        found.append(EvalSetting(setting.name + suffix, config))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2k,4k,7k")
    parser.add_argument("--depths", default="10,30,50,70,90")
    parser.add_argument("--budget", type=int, default=DEFAULTS.budget)
    parser.add_argument("--multi-tokens", default="4k")
    parser.add_argument("--facts", type=int, default=8)
    parser.add_argument("--tiers", default=None,
                        help="method:keep:bits[:kernel],... (keep 1 for the whole prompt)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model()
    tiers = TIERS
    if args.tiers:
        tiers = []
        for part in args.tiers.split(","):
            method, keep, bits, *kernel = part.split(":")
            kernel = [int(k) for k in kernel]
            tiers.append((None, None, int(bits)) if float(keep) >= 1 else (method, float(keep), int(bits), *kernel))
    chosen = settings(args.budget, tiers)
    lengths = parse_sizes(args.lengths, name="--lengths", minimum=16)
    depths = [d / 100 for d in parse_sizes(args.depths, name="--depths", minimum=0)]
    print(f"{loaded.name}, {str(loaded.dtype).replace('torch.', '')}, {len(chosen)} settings", flush=True)
    started = time.perf_counter()
    needles = needle_grid(loaded, lengths, depths, chosen,
                          on_cell=lambda name, n, d: None)
    needle_seconds = time.perf_counter() - started
    started = time.perf_counter()
    multi = many_questions(loaded, parse_sizes(args.multi_tokens, name="--multi-tokens")[0], args.facts, chosen)
    multi_seconds = time.perf_counter() - started
    full_bytes = multi.file_bytes["full"]
    print(f"needle grid {lengths} x {args.depths} ({needle_seconds:.0f} s); {multi.tokens}-token document with "
          f"{len(multi.facts)} facts ({multi_seconds:.0f} s)")
    print(f"{'setting':<52}{'needles':>10}{'per length':>22}{'multi':>8}{'file MiB':>10}{'vs full':>9}")
    for setting in chosen:
        grid = needles.found[setting.name]
        per_length = "/".join(str(sum(row)) for row in grid)
        size = multi.file_bytes[setting.name]
        print(f"{setting.name:<52}{sum(map(sum, grid)):>7}/{len(lengths) * len(depths):<2}{per_length:>22}"
              f"{sum(multi.found[setting.name]):>6}/{len(multi.facts)}{size / 2**20:>10.1f}{full_bytes / size:>8.1f}x")
    if args.json:
        args.json.write_text(json.dumps({"needles": asdict(needles), "multi": asdict(multi),
                                         "settings": [s.name for s in chosen]}, default=str))


if __name__ == "__main__":
    main()
