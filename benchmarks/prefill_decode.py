"""Full cache vs SnapKV on the embedded model, side by side in one run.

For each method: prefill seconds (best of --repeats), peak RSS growth during the prefill, KV bytes,
time to first token, decode ms/token over --decode-tokens forced tokens, and whether the needle was
found. Each method runs in its own child process so that one method's freed memory cannot hide
another's peak.

    .venv/bin/python benchmarks/prefill_decode.py --tokens 7000 --budget 1024
"""

import argparse
import json
import multiprocessing
from pathlib import Path


def measure(method: str, args: argparse.Namespace, results) -> None:
    import torch

    from snapkv.compression.config import SnapKVConfig
    from snapkv.io.documents import Document
    from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
    from snapkv.engine.models import load_model
    from snapkv.session import Session

    torch.set_num_threads(args.threads)
    loaded = load_model()
    haystack = build_haystack(loaded.tokenizer, filler_text(), args.tokens, 0.5, "48613")
    config = None if method == "full" else SnapKVConfig(
        budget=args.budget, window=args.window, kernel=args.kernel, pooling=args.pooling,
        query_aware=(method == "snapkv-query-aware"),
    )
    session = Session(loaded, config)
    prompt = session.prompt(Document(haystack.text))
    runs = [session.prepare(prompt, measure=True) for _ in range(args.repeats)]
    prepared = runs[-1]
    needle_text = "".join(session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX, max_new_tokens=8))
    timed = session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX,
                        max_new_tokens=args.decode_tokens, stop_at_end=False, measure=True)
    for _ in timed:
        pass
    cache = prepared.cache
    results[method] = {
        "method": method,
        "tokens": cache.original_length,
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "budget": None if config is None else config.budget,
        "prefill_seconds": min(run.prefill_seconds for run in runs),
        "prefill_peak_rss_growth_bytes": min(run.prefill_peak_bytes for run in runs),
        "kv_bytes_stored": cache.kv_bytes,
        "kv_bytes_full": cache.full_kv_bytes(),
        "ttft_seconds": timed.result.ttft_seconds,
        "decode_ms_per_token": timed.result.decode_ms_per_token,
        "needle_found": haystack.number in needle_text,
        "needle_answer": needle_text.strip(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--kernel", type=int, default=15)
    parser.add_argument("--pooling", default="max")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    context = multiprocessing.get_context("spawn")
    manager = context.Manager()
    results = manager.dict()
    for method in ("full", "snapkv", "snapkv-query-aware"):
        child = context.Process(target=measure, args=(method, args, results))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"{method} failed with exit code {child.exitcode}")
    rows = [dict(results[m]) for m in ("full", "snapkv", "snapkv-query-aware")]
    full = rows[0]
    print(f"embedded model, {full['dtype']}, {full['tokens']} tokens")
    print(f"{'method':<20}{'tokens':>7}{'prefill s':>11}{'peak RSS+':>12}{'KV MiB':>9}"
          f"{'TTFT s':>8}{'decode ms/tok':>15}  needle")
    for row in rows:
        print(f"{row['method']:<20}{row['tokens']:>7}{row['prefill_seconds']:>11.2f}"
              f"{row['prefill_peak_rss_growth_bytes'] / 2**20:>10.0f}Mi{row['kv_bytes_stored'] / 2**20:>9.1f}"
              f"{row['ttft_seconds']:>8.2f}{row['decode_ms_per_token']:>15.1f}  "
              f"{'found' if row['needle_found'] else 'missed: ' + row['needle_answer']}")
    summary = {}
    for row in rows[1:]:
        summary[row["method"]] = {
            "prefill_ratio": row["prefill_seconds"] / full["prefill_seconds"],
            "decode_speedup": full["decode_ms_per_token"] / row["decode_ms_per_token"],
            "kv_ratio": full["kv_bytes_stored"] / row["kv_bytes_stored"] if row["kv_bytes_stored"] else None,
            "kv_ratio_decoding": full["kv_bytes_full"] / row["kv_bytes_full"] * row["tokens"] / row["budget"],
            "prefill_peak_rss_ratio": row["prefill_peak_rss_growth_bytes"] / max(full["prefill_peak_rss_growth_bytes"], 1),
        }
        s = summary[row["method"]]
        print(f"{row['method']}: prefill {s['prefill_ratio']:.3f}x full, decode {s['decode_speedup']:.2f}x faster, "
              f"stored KV {s['kv_ratio']:.2f}x smaller, KV while decoding {s['kv_ratio_decoding']:.2f}x smaller "
              f"(length/budget {row['tokens'] / row['budget']:.2f}), prefill peak RSS growth {s['prefill_peak_rss_ratio']:.2f}x full")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
