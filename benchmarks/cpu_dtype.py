"""fp32 vs bf16 on the CPU for the embedded model: prefill and decode speed, and whether answers agree.

    .venv/bin/python benchmarks/cpu_dtype.py --tokens 2000
"""

import argparse
import time
from pathlib import Path

import torch

from snapkv.config import SnapKVConfig
from snapkv.generation import answer, prefill
from snapkv.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack
from snapkv.models import load_model
from snapkv.prompting import context_ids, question_ids

FILLER = Path(__file__).resolve().parent.parent / "samples" / "essays.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = SnapKVConfig(budget=512)
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(dtype=dtype, device="cpu")
        tokenizer = loaded.tokenizer
        haystack = build_haystack(tokenizer, FILLER.read_text(), args.tokens, 0.5, "73190")
        ids = context_ids(tokenizer, haystack.text)
        question = question_ids(tokenizer, NEEDLE_QUESTION, NEEDLE_ANSWER_PREFIX)
        started = time.perf_counter()
        cache = prefill(loaded.model, ids, config.stored_tier)
        prefill_seconds = time.perf_counter() - started
        text = tokenizer.decode(list(answer(loaded.model, cache, question, per_question=config, max_new_tokens=8,
                                            stop_ids=loaded.stop_ids)))
        stream = answer(loaded.model, cache, question, per_question=config, max_new_tokens=args.decode_tokens)
        next(stream)
        started = time.perf_counter()
        count = sum(1 for _ in stream)
        decode_ms = 1000 * (time.perf_counter() - started) / max(count, 1)
        print(f"{dtype:<9} prefill {prefill_seconds:.2f} s ({ids.shape[0]} tokens), decode {decode_ms:.1f} ms/token, "
              f"needle {'found' if haystack.number in text else 'missed'}: {text.strip()!r}")


if __name__ == "__main__":
    main()
