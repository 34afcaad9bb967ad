"""Where a follow-up question's time goes, each part with and without this round's change, side by side.

One document is prefilled once and saved with the default stored bits; then, taking turns for --rounds rounds:
- restore: load_cache with snapkv's C dequantizer (snapkv/kernels/dequantize.c) and with PyTorch's ops
  (SNAPKV_NATIVE_KERNELS=0 for that call);
- question pass + first token: SnapKV scored from the attention weights the pass computed (snapkv.compress)
  and scored from scratch (the window's queries and their attention again).
Medians are printed, with the ratio, and whether both ways found the needle.

    .venv/bin/python benchmarks/followup_parts.py --tokens 7k --rounds 5
"""

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from snapkv import compress, native
from snapkv.bench import NEEDLE_NUMBER
from snapkv.cachefile import load_cache
from snapkv.config import DEFAULTS
from snapkv.documents import Document
from snapkv.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.models import load_model
from snapkv.session import Session
from snapkv.sizes import parse_size


def timed_restore(path: Path, identity: dict, dtype: torch.dtype, native_kernels: bool) -> float:
    if not native_kernels:
        os.environ[native.DISABLE] = "0"
    try:
        started = time.perf_counter()
        load_cache(path, identity=identity, dtype=dtype)
        return time.perf_counter() - started
    finally:
        os.environ.pop(native.DISABLE, None)


def timed_question(session: Session, prepared, reuse: bool) -> tuple[float, str]:
    real = compress._scores_from_attention
    if not reuse:
        compress._scores_from_attention = lambda *args: None
    try:
        stream = session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX, max_new_tokens=6)
        text = "".join(stream)
        return stream.result.ttft_seconds, text
    finally:
        compress._scores_from_attention = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="7k")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model()
    tokens = parse_size(args.tokens)
    print(f"embedded model, {str(loaded.dtype).replace('torch.', '')}; {loaded.weights}; "
          f"C kernels: {native.unavailable_reason() or 'available'}")
    session = Session(loaded, replace(DEFAULTS, budget=args.budget), allow_extrapolation=True)
    document = Document(build_haystack(loaded.tokenizer, filler_text(), tokens, 0.5, NEEDLE_NUMBER).text)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "document.snapkv"
        built = session.prepare(session.prompt(document, max_tokens=tokens))
        session.save(built, path)
        prepared = session.load_file(path, check_sources=False)
        print(f"{built.tokens} tokens prefilled in {built.prefill_seconds:.1f} s; stored "
              f"{built.cache.tier.bits} bits, {path.stat().st_size / 2**20:.1f} MiB")
        restore = {True: [], False: []}
        question = {True: [], False: []}
        answers = {}
        for _ in range(args.rounds):
            for flag in (True, False):
                restore[flag].append(timed_restore(path, loaded.identity, loaded.dtype, flag))
                seconds, answers[flag] = timed_question(session, prepared, flag)
                question[flag].append(seconds)
    for label, parts, names in (("load_cache", restore, ("C dequantizer", "PyTorch ops")),
                                ("question pass + first token", question, ("scored from its attention",
                                                                           "scored from scratch"))):
        new, old = statistics.median(parts[True]), statistics.median(parts[False])
        print(f"{label}: {names[0]} {new:.3f} s, {names[1]} {old:.3f} s ({old / new:.2f}x) "
              f"[{', '.join(f'{x:.3f}' for x in parts[True])} | {', '.join(f'{x:.3f}' for x in parts[False])}]")
    for flag, text in answers.items():
        print(f"answer ({'scored from its attention' if flag else 'scored from scratch'}): {text.strip()!r}, "
              f"needle {'found' if NEEDLE_NUMBER in text else 'missed'}")


if __name__ == "__main__":
    main()
