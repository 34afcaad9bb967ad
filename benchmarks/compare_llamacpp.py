"""snapkv against llama.cpp on the same GGUF file, same prompt ids, same machine, one run, side by side.

llama.cpp is what a CPU user would run instead: it decodes with the full cache, reading the weights in the
GGUF's own quantized form. This prefills one haystack prompt with each and decodes --decode-tokens greedy
tokens: snapkv with the full cache and with SnapKV (--budget, query-aware, the default stored tier), then
llama-cpp-python in its own environment (it compiles from source, about 15 min on 2 cores), on the very
token ids snapkv prefilled.

    python3 -m venv /tmp/llama-venv && /tmp/llama-venv/bin/pip install llama-cpp-python
    .venv/bin/python benchmarks/compare_llamacpp.py --llama-python /tmp/llama-venv/bin/python --tokens 7k
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def llama_side(args) -> None:
    """Runs in the llama-cpp-python environment: prefill the ids, then decode greedily, timing each part."""
    import numpy as np
    from llama_cpp import Llama

    ids = json.loads(Path(args.ids).read_text())
    llm = Llama(model_path=args.gguf, n_ctx=len(ids) + args.decode_tokens + 8, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=512, verbose=False)
    vocab = llm.n_vocab()

    def last_logits():  # the last evaluated position's logits (only it has any without logits_all)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

    started = time.perf_counter()
    llm.eval(ids)
    prefilled = time.perf_counter()
    token = int(last_logits().argmax())
    first = time.perf_counter()
    tokens = [token]
    for _ in range(args.decode_tokens - 1):
        llm.eval([token])
        token = int(last_logits().argmax())
        tokens.append(token)
    ended = time.perf_counter()
    Path(args.out).write_text(json.dumps({
        "prefill_seconds": prefilled - started, "ttft_seconds": first - started,
        "decode_ms_per_token": 1000 * (ended - first) / (args.decode_tokens - 1), "tokens": tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", help="python of the environment that has llama-cpp-python")
    parser.add_argument("--tokens", default="7k")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--allow-extrapolation", action="store_true",
                        help="lengths past the model's context (32k on the embedded model): speed only")
    parser.add_argument("--side", default="snapkv", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "llama":
        llama_side(args)
        return

    import torch

    from snapkv.measure.bench import run_bench
    from snapkv.engine.conversion import embedded_gguf_path
    from snapkv.io.documents import Document
    from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
    from snapkv.engine.models import load_model
    from snapkv.session import Session
    from snapkv.base.sizes import parse_size

    torch.set_num_threads(args.threads)
    length = parse_size(args.tokens, name="--tokens")
    loaded = load_model()
    result = run_bench(loaded, [length], [args.budget], decode_tokens=args.decode_tokens, repeats=3,
                       followup=False, allow_extrapolation=args.allow_extrapolation,
                       on_progress=lambda text: print(text, file=sys.stderr, flush=True))
    # llama.cpp gets the ids of the full cache's prompt and question, exactly as snapkv fed them
    session = Session(loaded, None, allow_extrapolation=args.allow_extrapolation)
    prompt = session.prompt(Document(build_haystack(loaded.tokenizer, filler_text(), length, 0.5, "48613").text),
                        max_tokens=length)
    question = loaded.prompter.question_ids(NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX)
    ids = prompt.ids.tolist() + question.tolist()
    with tempfile.TemporaryDirectory() as folder:
        ids_file, out_file = Path(folder) / "ids.json", Path(folder) / "llama.json"
        ids_file.write_text(json.dumps(ids))
        subprocess.run([args.llama_python, __file__, "--side", "llama", "--ids", str(ids_file),
                        "--gguf", str(embedded_gguf_path()), "--out", str(out_file),
                        "--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads)], check=True)
        theirs = json.loads(out_file.read_text())
    answer = loaded.tokenizer.decode(theirs["tokens"])
    print(f"{loaded.name}, snapkv in {loaded.precision}, llama.cpp on the GGUF as shipped; "
          f"{args.threads} threads; read bandwidth {result.read_bandwidth / 1e9:.1f} GB/s")
    print(f"{'engine':<28}{'tokens':>7}{'prefill s':>11}{'decode ms/tok':>15}{'floor ms':>10}{'needle':>8}")
    for row in result.rows:
        name = "snapkv full cache" if row.method == "full" else f"snapkv SnapKV {row.budget}"
        if row.estimated:
            print(f"{name:<28}{row.length:>7}{row.prefill_seconds:>10.0f}~ (estimated: not run)")
            continue
        needle = "-" if row.needle_found is None else "found" if row.needle_found else "missed"
        print(f"{name:<28}{row.length:>7}{row.prefill_seconds:>11.2f}{row.decode_ms_per_token:>15.1f}"
              f"{row.floor_ms_per_token:>10.1f}{needle:>8}")
    print(f"{'llama.cpp full cache':<28}{len(prompt.ids):>7}{theirs['prefill_seconds']:>11.2f}"
          f"{theirs['decode_ms_per_token']:>15.1f}{'':>10}{'found' if '48613' in answer else 'missed':>8}")
    snapkv_row = result.rows[-1]
    print(f"SnapKV decode / llama.cpp decode: {snapkv_row.decode_ms_per_token / theirs['decode_ms_per_token']:.2f}x "
          f"(below 1: snapkv faster)")


if __name__ == "__main__":
    main()
