"""Stored bits side by side on needles and many-facts documents, from one prefill per document.

For each document the whole prompt is prefilled once (16 bits) and rounded to every setting in memory,
as the saved file would hold it: plain bits ("8", "4/3") or a sharper share ("4/2+20%@4": each head's 20%
of positions the pseudo-question probes rank highest in 4 bits, the rest in 4/2; MiKV's idea, arXiv
2402.18096). Every setting answers with per-question SnapKV at the default budget, like the default file;
"full" is the uncompressed cache. The ratio is the stored bytes of the keys and values (codes, scales,
masks) against the full cache in 16 bits.

    .venv/bin/python benchmarks/sharp_share.py --settings 8,4/3,4/2+20%@4,3+20%@4 --lengths 4k,7k
"""

import argparse
import random
import time
from dataclasses import replace

import torch

from snapkv.base.bits import Bits
from snapkv.compression.config import DEFAULTS
from snapkv.io.documents import Document
from snapkv.measure.evaluation import multi_fact_document
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.engine.models import load_model
from snapkv.session import Session
from snapkv.base.sizes import parse_sizes
from snapkv.engine.tiers import at_stored_precision


def rounded(loaded, prepared, settings: list[Bits]) -> dict:
    """name -> (the prepared document with its whole cache stored that way, ratio against 16 bits)."""
    whole = prepared.cache  # the whole prompt, 16 bits
    full_bytes = whole.full_kv_bytes(element_size=2)
    found = {"full": (prepared.answering_with(None), 1.0)}
    for bits in settings:
        cache = at_stored_precision(loaded.model, loaded.prompter, whole, bits)
        found[str(bits)] = (replace(prepared, cache=cache), full_bytes / cache.stored_kv_bytes)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="8,4/3,4/2+20%@4,3+20%@4", help="stored bits, comma-separated")
    parser.add_argument("--lengths", default="4k,7k")
    parser.add_argument("--depths", default="0,10,20,30,40,50,60,70,80,90,100")
    parser.add_argument("--facts", default="4600:8,7200:10", help="TOKENS:COUNT,... many-facts documents")
    args = parser.parse_args()
    torch.set_num_threads(2)
    settings = [Bits.parse(text) for text in args.settings.split(",")]
    loaded = load_model()
    session = Session(loaded, replace(DEFAULTS, store_bits=16))
    print(f"{loaded.name}, {str(loaded.dtype).replace('torch.', '')}, budget {DEFAULTS.budget}", flush=True)
    needles, facts, ratios = {}, {}, {}
    started = time.perf_counter()
    for length in parse_sizes(args.lengths, name="--lengths", minimum=16):
        for depth in parse_sizes(args.depths, name="--depths", minimum=0):
            number = str(random.Random(length * 1000 + depth).randrange(10000, 99999))
            haystack = build_haystack(loaded.tokenizer, filler_text(), length, depth / 100, number)
            for name, (prepared, ratio) in rounded(loaded, session.prepare(Document(haystack.text)), settings).items():
                text = "".join(session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX,
                                           max_new_tokens=10))
                needles.setdefault(name, []).append(number in text)
                ratios.setdefault(name, []).append(ratio)
        print(f"{length} tokens done ({time.perf_counter() - started:.0f} s)", flush=True)
    for part in filter(None, args.facts.split(",")):
        tokens, count = (int(v) for v in part.split(":"))
        text, document_facts = multi_fact_document(loaded.tokenizer, filler_text(), tokens, count)
        for name, (prepared, _) in rounded(loaded, session.prepare(Document(text)), settings).items():
            answers = ("".join(session.ask(prepared, fact.question, answer_prefix=fact.answer_prefix,
                                           max_new_tokens=10)) for fact in document_facts)
            facts.setdefault(name, []).append(f"{sum(f.number in a for f, a in zip(document_facts, answers))}/{count}")
    print(f"{'stored bits':<16}{'vs 16-bit (shortest-longest)':>30}{'needles':>10}{'facts':>14}")
    for name, ratio in ratios.items():
        print(f"{name:<16}{f'{min(ratio):.2f}-{max(ratio):.2f}x':>30}{sum(needles[name]):>7}/{len(needles[name]):<3}"
              f"{' '.join(facts.get(name, [])):>13}")


if __name__ == "__main__":
    main()
