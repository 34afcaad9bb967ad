"""The prefill: full cache against SnapKV, its overhead, fp32 against bf16, in chunks, and the longest that fits.

One script, one subcommand per study (each says what it measures with --help):

    methods    full cache against SnapKV: prefill, memory, first token, decode, needle
    overhead   prefill seconds of the full cache against SnapKV, interleaved
    dtype      fp32 against bf16 on the CPU: speed, and whether answers agree
    chunks     needles found with the exact prefill and with chunks
    longest    the longest prompt that fits, at growing lengths

    .venv/bin/python benchmarks/prefill.py SUBCOMMAND [OPTIONS]
"""

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch

from snapkv.compression.config import SnapKVConfig
from snapkv.engine.models import load_model
from snapkv.io.documents import Document
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.measure.studies import run_study
from snapkv.session import Session

METHODS_DOC = """Full cache vs SnapKV on the embedded model, side by side in one run.

For each method: prefill seconds (best of --repeats), peak RSS growth during the prefill, KV bytes,
time to first token, decode ms/token over --decode-tokens forced tokens, and whether the needle was
found. Each method runs in its own child process so that one method's freed memory cannot hide
another's peak.

    .venv/bin/python benchmarks/prefill.py methods --tokens 7000 --budget 1024
"""


def measure(method: str, args: argparse.Namespace, results) -> None:
    import torch

    from snapkv.compression.config import SnapKVConfig
    from snapkv.engine.models import load_model
    from snapkv.io.documents import Document
    from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
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


def run_methods(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=METHODS_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--kernel", type=int, default=15)
    parser.add_argument("--pooling", default="max")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

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


OVERHEAD_DOC = """Prefill seconds of the full cache vs SnapKV, interleaved in one process so both see the same machine.

    .venv/bin/python benchmarks/prefill.py overhead --tokens 7000 --budget 1024 --rounds 3
"""


def run_overhead(argv: list[str]) -> None:
    torch.set_num_threads(2)
    parser = argparse.ArgumentParser(description=OVERHEAD_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7000)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
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


DTYPE_DOC = """fp32 vs bf16 on the CPU for the embedded model: prefill and decode speed, and whether answers agree.

    .venv/bin/python benchmarks/prefill.py dtype --tokens 2000
"""


def run_dtype(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=DTYPE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=32)
    args = parser.parse_args(argv)
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


CHUNKS_DOC = """What the prefill in chunks costs in answers: needles found with the exact prefill and with chunks, on the
same documents, one run.

Settings compared (embedded model; per-question budget --budget): the full cache; query-aware with the exact
prefill (the default); query-aware prefilled in chunks (stored tier 4 x budget, cut per question); the
document window (budget) with the exact prefill and in chunks. Prefill seconds are summed per setting.

    .venv/bin/python benchmarks/prefill.py chunks --lengths 4k,7k --depths 10,30,50,70,90 --chunk 1024
"""


def run_chunks(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=CHUNKS_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4k,7k")
    parser.add_argument("--depths", default="10,30,50,70,90")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--chunk", default="1024", help="prefill chunk size(s), comma-separated")
    args = parser.parse_args(argv)

    import torch

    from snapkv.base.sizes import parse_sizes
    from snapkv.compression.config import SnapKVConfig
    from snapkv.engine.models import load_model
    from snapkv.io.documents import Document
    from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
    from snapkv.session import Session

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


LONGEST_DOC = """The longest prompt that fits: prefill with SnapKV at growing lengths until memory says no.

For each length: the preflight estimate, then (if it fits) a prefill compressed at prefill time (the
document-window tier, so that only one layer's full cache ever exists), the measured peak memory beside
the estimate, and decode ms/token. Stops at the first length the estimate refuses or that runs out of
memory. Meant for a GPU with a random-weights shape:

    python benchmarks/prefill.py longest --random-weights samples/configs/llama-3.1-8b.json \
        --budget 4096 --lengths 128k,256k,512k,768k,1m

On CPU, with the tiny shape, it is a quick check of the script itself:

    .venv/bin/python benchmarks/prefill.py longest --random-weights samples/configs/tiny-llama.json \
        --lengths 1k,2k --budget 256
"""


def run_longest(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=LONGEST_DOC.splitlines()[0])
    parser.add_argument("--random-weights", required=True, help="config.json of the model shape")
    parser.add_argument("--lengths", default="128k,256k,512k,768k,1m")
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tokenizer", default=None, help="folder of tokenizer files (default: the embedded model's)")
    args = parser.parse_args(argv)

    import torch

    from snapkv.base.errors import OutOfMemoryError
    from snapkv.base.sizes import parse_sizes
    from snapkv.compression.config import SnapKVConfig
    from snapkv.engine.memory import check_prefill_fits, is_out_of_memory, release_device_memory
    from snapkv.engine.models import random_weights_model
    from snapkv.io.documents import Document
    from snapkv.session import Prompt, Session

    loaded = random_weights_model(args.random_weights, device=args.device, tokenizer=args.tokenizer)
    settings = SnapKVConfig(budget=args.budget, query_aware=False)
    session = Session(loaded, settings, allow_extrapolation=True)
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    rows = []
    for length in parse_sizes(args.lengths, name="--lengths", minimum=16):
        row = {"length": length, "budget": args.budget}
        rows.append(row)
        try:
            estimate = check_prefill_fits(loaded.model, length, loaded.device, loaded.dtype, settings.stored_tier)
        except OutOfMemoryError as error:
            row["refused_by_estimate"] = str(error)
            break
        row["estimate_bytes"] = estimate.total_bytes
        # random token ids of exactly `length` (the answers of random weights are meaningless anyway)
        ids = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(length))
        try:
            prepared = session.prepare(Prompt(Document(""), ids, None), measure=True)
            row["prefill_seconds"] = prepared.prefill_seconds
            row["prefill_peak_bytes"] = prepared.prefill_peak_bytes
            row["kv_bytes"] = prepared.cache.kv_bytes
            stream = session.ask(prepared, "Which number?", max_new_tokens=args.decode_tokens, stop_at_end=False,
                                 measure=True)
            for _ in stream:
                pass
            row["decode_ms_per_token"] = stream.result.decode_ms_per_token
            del prepared
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            release_device_memory(loaded.device)
            row["out_of_memory"] = f"{type(error).__name__}: {str(error)[:200]}"
            break
        print(json.dumps(row), file=sys.stderr, flush=True)
    fitted = [row["length"] for row in rows if "prefill_seconds" in row]
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    print(json.dumps({"model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype),
                      "weights_bytes": weights,  # included in CUDA peaks, not in the estimate
                      "longest_fitted": max(fitted, default=None), "rows": rows}))


STUDIES = {"methods": run_methods, "overhead": run_overhead, "dtype": run_dtype, "chunks": run_chunks, "longest": run_longest}


if __name__ == "__main__":
    run_study(STUDIES, __doc__)
