"""fp32 vs bf16 on the CPU for the embedded model: prefill and decode speed, and whether answers agree.

    .venv/bin/python benchmarks/cpu_dtype.py --tokens 2000
"""

import argparse

import torch

from snapkv.compression.config import SnapKVConfig
from snapkv.io.documents import Document
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.engine.models import load_model
from snapkv.session import Session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = SnapKVConfig(budget=512)
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(dtype=dtype, device="cpu")
        session = Session(loaded, config)
        haystack = build_haystack(loaded.tokenizer, filler_text(), args.tokens, 0.5, "73190")
        prepared = session.prepare(Document(haystack.text), measure=True)
        needle = session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX, max_new_tokens=8)
        text = "".join(needle)
        timed = session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX,
                            max_new_tokens=args.decode_tokens, stop_at_end=False, measure=True)
        for _ in timed:
            pass
        print(f"{dtype:<9} prefill {prepared.prefill_seconds:.2f} s ({prepared.tokens} tokens), decode "
              f"{timed.result.decode_ms_per_token:.1f} ms/token, "
              f"needle {'found' if haystack.number in text else 'missed'}: {text.strip()!r}")


if __name__ == "__main__":
    main()
