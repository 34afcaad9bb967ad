"""Where a follow-up question's time goes, each part with and without a change, side by side.

One document is prefilled once and saved with the default stored bits; then, taking turns for --rounds rounds:
- restore: load_cache with snapkv's C dequantizer (snapkv/native/kernels/dequantize.c) and with PyTorch's ops
  (SNAPKV_KERNELS=off for that call);
- question pass + first token, over the cache loaded as `ask` loads it (with room for the question) unless said:
    C attention, into the room: the question's attention by snapkv/native/kernels/few_rows.c over a deferred cache, each
        layer restored into one buffer and the question written into its room (snapkv.storage.deferred): what snapkv does;
    C attention, appended: the same over a cache restored whole at load (each layer copied to append the question);
    matmuls, into the room: PyTorch's matmuls for the attention (SNAPKV_KERNELS=off for the pass);
    scored from scratch: SnapKV's scores computed again from the window's queries, not taken from the pass.
Medians are printed, with each one's ratio to the first, and whether every way found the needle.

    .venv/bin/python benchmarks/followup_parts.py --tokens 8k --rounds 5
"""

import argparse
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from snapkv.compression import compress
from snapkv import native
from snapkv.measure.bench import NEEDLE_NUMBER
from snapkv.storage.cachefile import load_cache
from snapkv.compression.config import DEFAULTS
from snapkv.io.documents import Document
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.engine.models import load_model
from snapkv.session import Session
from snapkv.base.sizes import parse_size


@contextmanager
def kernels_off(off: bool):
    if off:
        os.environ[native.SETTING] = "off"
    try:
        yield
    finally:
        os.environ.pop(native.SETTING, None)


def timed_restore(path: Path, identity: dict, dtype: torch.dtype, native_kernels: bool) -> float:
    with kernels_off(not native_kernels):
        started = time.perf_counter()
        load_cache(path, identity=identity, dtype=dtype)
        return time.perf_counter() - started


@contextmanager
def scoring_from_scratch(on: bool):
    real = compress._scores_from_attention
    if on:
        compress._scores_from_attention = lambda *args: None
    try:
        yield
    finally:
        compress._scores_from_attention = real


def timed_question(session: Session, prepared) -> tuple[float, str]:
    stream = session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX, max_new_tokens=6,
                         measure=True)
    text = "".join(stream)
    return stream.result.ttft_seconds, text


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
        appended = replace(prepared, cache=load_cache(path, identity=loaded.identity, dtype=loaded.dtype)[0])
        ways = {  # name: (prepared document, kernels off, scored from scratch)
            "C attention, into the room": (prepared, False, False),
            "C attention, appended": (appended, False, False),
            "matmuls, into the room": (prepared, True, False),
            "scored from scratch": (prepared, False, True),
        }
        restore = {True: [], False: []}
        question = {name: [] for name in ways}
        answers = {}
        for _ in range(args.rounds):
            for flag in (True, False):
                restore[flag].append(timed_restore(path, loaded.identity, loaded.dtype, flag))
            for name, (document, off, scratch) in ways.items():
                with kernels_off(off), scoring_from_scratch(scratch):
                    seconds, answers[name] = timed_question(session, document)
                question[name].append(seconds)
    new, old = statistics.median(restore[True]), statistics.median(restore[False])
    print(f"load_cache: C dequantizer {new:.3f} s, PyTorch ops {old:.3f} s ({old / new:.2f}x) "
          f"[{', '.join(f'{x:.3f}' for x in restore[True])} | {', '.join(f'{x:.3f}' for x in restore[False])}]")
    first = statistics.median(question[next(iter(ways))])
    for name, seconds in question.items():
        median = statistics.median(seconds)
        print(f"question pass + first token, {name}: {median:.3f} s ({median / first:.2f}x) "
              f"[{', '.join(f'{x:.3f}' for x in seconds)}]; answer {answers[name].strip()!r}, "
              f"needle {'found' if NEEDLE_NUMBER in answers[name] else 'missed'}")


if __name__ == "__main__":
    main()
