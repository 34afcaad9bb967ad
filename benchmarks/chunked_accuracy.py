"""What the prefill in chunks costs in answers: needles found with the exact prefill and with chunks, on the
same documents, one run.

Settings compared (embedded model; per-question budget --budget): the full cache; query-aware with the exact
prefill (the default); query-aware prefilled in chunks (stored tier 4 x budget, cut per question); the
document window (budget) with the exact prefill and in chunks. Prefill seconds are summed per setting.

    .venv/bin/python benchmarks/chunked_accuracy.py --lengths 4k,7k --depths 10,30,50,70,90 --chunk 1024
"""

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4k,7k")
    parser.add_argument("--depths", default="10,30,50,70,90")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--chunk", default="1024", help="prefill chunk size(s), comma-separated")
    args = parser.parse_args()

    import torch

    from snapkv.compression.config import SnapKVConfig
    from snapkv.io.documents import Document
    from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
    from snapkv.engine.models import load_model
    from snapkv.session import Session
    from snapkv.base.sizes import parse_sizes

    torch.set_num_threads(2)
    loaded = load_model()
    settings = {"full cache": None, "query-aware, exact": SnapKVConfig(budget=args.budget),
                "document window, exact": SnapKVConfig(budget=args.budget, query_aware=False)}
    for chunk in parse_sizes(args.chunk, name="--chunk"):
        settings[f"query-aware, chunks of {chunk}"] = SnapKVConfig(budget=args.budget, prefill_chunk=chunk)
        settings[f"document window, chunks of {chunk}"] = SnapKVConfig(budget=args.budget, query_aware=False,
                                                                       prefill_chunk=chunk)
    lengths = parse_sizes(args.lengths, name="--lengths")
    depths = parse_sizes(args.depths, name="--depths", minimum=0)
    found = {name: {length: 0 for length in lengths} for name in settings}
    seconds = {name: 0.0 for name in settings}
    for length in lengths:
        for depth in depths:
            number = str(10000 + (length * 13 + depth * 997) % 89999)
            document = Document(build_haystack(loaded.tokenizer, filler_text(), length, depth / 100, number).text)
            for name, config in settings.items():
                session = Session(loaded, config)
                started = time.perf_counter()
                prepared = session.prepare(session.prompt(document, max_tokens=length))
                seconds[name] += time.perf_counter() - started
                text = "".join(session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX,
                                           max_new_tokens=8))
                found[name][length] += number in text
    print(f"{loaded.name}, {str(loaded.dtype).replace('torch.', '')}, budget {args.budget}, depths {args.depths}")
    print(f"{'setting':<36}" + "".join(f"{length:>8}" for length in lengths) + f"{'prefill s':>11}")
    for name in settings:
        print(f"{name:<36}" + "".join(f"{found[name][length]:>6}/{len(depths)}" for length in lengths)
              + f"{seconds[name]:>11.1f}")


if __name__ == "__main__":
    main()
