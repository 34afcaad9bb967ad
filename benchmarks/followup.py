"""The cost of a follow-up question from a saved cache vs prefilling the document again, in one run.

For each mode: prefill + save, then (as a later process would) load the file and answer; reports
prefill seconds, load seconds, time to first token, the ratio, file size vs the tensors it holds, and
load time per MB.

    .venv/bin/python benchmarks/followup.py --tokens 7000 --budget 1024
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from snapkv.config import SnapKVConfig
from snapkv.documents import Document
from snapkv.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.models import load_model
from snapkv.session import Session
from snapkv.store import CacheStore


def first_token_seconds(session: Session, prepared) -> tuple[float, str]:
    stream = session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX, max_new_tokens=8)
    text = "".join(stream)
    return stream.result.ttft_seconds, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--budget", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model()
    haystack = build_haystack(loaded.tokenizer, filler_text(), args.tokens, 0.5, "58207")
    document = Document(haystack.text)
    loaded.identity  # computed once per model load, not per question
    print(f"embedded model, {str(loaded.dtype).replace('torch.', '')}")
    for mode, settings in (("document-window", SnapKVConfig(budget=args.budget, query_aware=False)),
                           ("query-aware", SnapKVConfig(budget=args.budget, query_aware=True))):
        with tempfile.TemporaryDirectory() as folder:
            session = Session(loaded, settings, store=CacheStore(Path(folder)))
            built = session.prepare(document)
            build_ttft, _ = first_token_seconds(session, built)
            started = time.perf_counter()
            reloaded = session.prepare(document)  # a store hit: tokenize, look up, load, validate
            lookup_seconds = time.perf_counter() - started
            ttft, text = first_token_seconds(session, reloaded)
            assert reloaded.hit
            cache = built.cache
            tensor_bytes = cache.kv_bytes + sum(p.numel() * 4 for p in cache.positions) + cache.original_length * 4
            followup = lookup_seconds + ttft
            mb = reloaded.file_bytes / 1e6
            print(f"{mode}: {cache.original_length} tokens, kept {cache.kept_tokens}/head; "
                  f"prefill {built.prefill_seconds:.2f} s + save {built.save_seconds:.2f} s; "
                  f"follow-up: lookup+load {lookup_seconds:.3f} s (of which load {reloaded.load_seconds:.3f} s) "
                  f"+ first token {ttft:.3f} s = {followup:.3f} s; "
                  f"re-prefill / follow-up = {built.prefill_seconds / followup:.1f}x "
                  f"((prefill + first token) / follow-up = {(built.prefill_seconds + build_ttft) / followup:.1f}x); "
                  f"file {reloaded.file_bytes / 2**20:.1f} MiB vs tensors {tensor_bytes / 2**20:.1f} MiB "
                  f"({reloaded.file_bytes / tensor_bytes:.4f}x); load {1000 * reloaded.load_seconds / mb:.2f} ms/MB; "
                  f"needle {'found' if haystack.number in text else 'missed: ' + text.strip()}")


if __name__ == "__main__":
    main()
