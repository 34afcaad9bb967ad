"""snapkv against llama.cpp on the same GGUF file, same prompt ids, same machine, one run, side by side.

llama.cpp is what a CPU user would run instead: it decodes with the full cache, reading the weights in the
GGUF's own quantized form. This prefills one haystack prompt with each and decodes --decode-tokens greedy
tokens: snapkv with the full cache and with SnapKV (--budget, query-aware, the default stored tier), then
llama-cpp-python in its own environment (it compiles from source, about 15 min on 2 cores), on the very
token ids snapkv prefilled.

--kv-types f16,q8_0,q4_0: instead, llama.cpp's own KV cache types as the anchor of snapkv's stored tiers (README, What
is saved): every question of the fidelity documents (`snapkv eval fidelity`'s, --only, and its needle grid at
--needle-lengths) answered greedily by llama.cpp with its full cache in each type, on the same prompt and question
ids snapkv answers, up to the same 64 tokens; each type's answers compared with f16's by snapkv's measure
(snapkv.io.facts: identical, changed, changed where f16 was right, facts lost and gained). -o keeps every answer.

    python3 -m venv /tmp/llama-venv && /tmp/llama-venv/bin/pip install llama-cpp-python
    .venv/bin/python benchmarks/compare_llamacpp.py --llama-python /tmp/llama-venv/bin/python --tokens 7k
    .venv/bin/python benchmarks/compare_llamacpp.py --llama-python /tmp/llama-venv/bin/python -m model.gguf --tokens 8k
    .venv/bin/python benchmarks/compare_llamacpp.py --llama-python /tmp/llama-venv/bin/python --kv-types f16,q8_0,q4_0
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def peak_rss() -> int:
    """This process's peak resident memory in bytes, since its program started (VmHWM: unlike getrusage's maximum,
    not carried over from the process that started it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


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
        "peak_rss_bytes": peak_rss(),
        "prefill_seconds": prefilled - started, "ttft_seconds": first - started,
        "decode_ms_per_token": 1000 * (ended - first) / (args.decode_tokens - 1), "tokens": tokens}))


KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7}  # ggml's type numbers


def llama_answers(args) -> None:
    """Runs in the llama-cpp-python environment: each document prefilled once per KV type, each question's answer
    decoded greedily after it (the question's positions dropped again before the next)."""
    import numpy as np
    from llama_cpp import Llama

    work = json.loads(Path(args.ids).read_text())
    answers = {}
    for kind in work["kv_types"]:
        llm = Llama(model_path=args.gguf, n_ctx=work["context"], n_threads=args.threads, n_threads_batch=args.threads,
                    n_batch=512, type_k=KV_TYPES[kind], type_v=KV_TYPES[kind], flash_attn=True, verbose=False)
        vocab = llm.n_vocab()
        answers[kind] = {}
        for document in work["documents"]:
            print(f"llama.cpp {kind}: {document['name']} ({len(document['ids'])} tokens)", file=sys.stderr, flush=True)
            llm.reset()
            llm.eval(document["ids"])
            prefix = llm.n_tokens
            answers[kind][document["name"]] = []
            for question in document["questions"]:
                llm._ctx.kv_cache_seq_rm(-1, prefix, -1)
                llm.n_tokens = prefix
                llm.eval(question)
                tokens = []
                while len(tokens) < work["answer_tokens"]:
                    token = int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax())
                    if token in work["stop_ids"]:
                        break
                    tokens.append(token)
                    llm.eval([token])
                answers[kind][document["name"]].append(tokens)
    Path(args.out).write_text(json.dumps(answers))


def kv_types_fidelity(args) -> None:
    """The snapkv side of --kv-types: the ids out, llama.cpp's answers back, scored as `snapkv eval fidelity` scores."""
    from snapkv.engine.conversion import embedded_gguf_path
    from snapkv.engine.models import cpu_description, load_model
    from snapkv.io.documents import Document
    from snapkv.io.facts import fact_found
    from snapkv.measure.fidelity import MAX_ANSWER_TOKENS, compare_settings, load_documents, needle_documents
    from snapkv.session import Session
    from snapkv.base.sizes import parse_size

    loaded = load_model(dtype="float32")
    documents = load_documents(names=args.only.split(",") if args.only else None)
    lengths = [parse_size(text, name="--needle-lengths") for text in args.needle_lengths.split(",") if text]
    documents += needle_documents(loaded.tokenizer, lengths, [0.1, 0.4, 0.6, 0.9])
    session = Session(loaded, None)
    work = {"kv_types": args.kv_types.split(","), "answer_tokens": MAX_ANSWER_TOKENS, "context": loaded.context_length,
            "stop_ids": sorted(loaded.stop_ids), "documents": []}
    for document in documents:
        ids = session.prompt(Document(document.text)).ids.tolist()
        questions = [loaded.prompter.question_ids(q.question, answer_prefix=q.answer_prefix).tolist()
                     for q in document.questions]
        work["documents"].append({"name": document.name, "ids": ids, "questions": questions})
    with tempfile.TemporaryDirectory() as folder:
        ids_file, out_file = Path(folder) / "work.json", Path(folder) / "answers.json"
        ids_file.write_text(json.dumps(work))
        started = time.perf_counter()
        subprocess.run([args.llama_python, __file__, "--side", "llama-answers", "--ids", str(ids_file),
                        "--gguf", gguf, "--out", str(out_file), "--threads", str(args.threads)],
                       check=True)
        seconds = time.perf_counter() - started
        answers = json.loads(out_file.read_text())
    records = []
    for document in documents:
        record = {"name": document.name, "questions": [q.__dict__ for q in document.questions], "answers": {},
                  "file_bytes": {}, "seconds": {}}
        for kind in work["kv_types"]:
            texts = [(q.answer_prefix + loaded.tokenizer.decode(tokens)).strip()
                     for q, tokens in zip(document.questions, answers[kind][document.name])]
            record["answers"][kind] = [{"text": text, "found": fact_found(text, q.answer)}
                                       for q, text in zip(document.questions, texts)]
        records.append(record)
    reference = work["kv_types"][0]
    print(f"llama.cpp's KV types against its {reference} cache, full cache, greedy, {MAX_ANSWER_TOKENS} tokens compared; "
          f"{len(records)} documents; {cpu_description()}; {seconds / 60:.1f} min")
    print(f"{'KV type':<10}{'questions':>10}{'identical':>10}{'changed':>9}{'of right':>9}{'lost':>6}{'gained':>7}"
          f"{'found':>7}")
    for kind in work["kv_types"]:
        comparison = compare_settings(records, kind, reference)
        print(f"{kind:<10}{comparison.questions:>10}{comparison.agreed:>10}{comparison.changed:>9}"
              f"{comparison.changed_right:>9}{comparison.lost:>6}{comparison.gained:>7}{comparison.found:>7}")
    if args.output:
        Path(args.output).write_text(json.dumps({"kv_types": work["kv_types"], "cpu": cpu_description(),
                                                 "seconds": seconds, "documents": records}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-python", help="python of the environment that has llama-cpp-python")
    parser.add_argument("--tokens", default="7k")
    parser.add_argument("-m", "--model", help="a GGUF file both run (default: the embedded model's)")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--allow-extrapolation", action="store_true",
                        help="lengths past the model's context (32k on the embedded model): speed only")
    parser.add_argument("--kv-types", help="llama.cpp's KV cache types to compare, the first the reference: "
                                           "f16,q8_0,q4_0 (see the docstring)")
    parser.add_argument("--only", help="--kv-types: only these fidelity documents, comma-separated")
    parser.add_argument("--needle-lengths", default="7k", help="--kv-types: the needle grid's lengths ('' for none)")
    parser.add_argument("-o", "--output", help="--kv-types: every answer as JSON here")
    parser.add_argument("--side", default="snapkv", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "llama":
        llama_side(args)
        return
    if args.side == "llama-answers":
        llama_answers(args)
        return
    if args.kv_types:
        unknown = sorted(set(args.kv_types.split(",")) - set(KV_TYPES))
        if unknown or not args.llama_python:
            parser.error(f"--kv-types takes {', '.join(KV_TYPES)} and needs --llama-python"
                         + (f"; not {', '.join(unknown)}" if unknown else ""))
        kv_types_fidelity(args)
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
    loaded = load_model(args.model)
    gguf = args.model or str(embedded_gguf_path())
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
                        "--gguf", gguf, "--out", str(out_file),
                        "--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads)], check=True)
        theirs = json.loads(out_file.read_text())
    from snapkv.engine.models import cpu_description

    answer = loaded.tokenizer.decode(theirs["tokens"])
    print(f"{loaded.name}, snapkv in {loaded.precision}, llama.cpp on the GGUF as shipped; "
          f"{args.threads} threads; read bandwidth {result.read_bandwidth / 1e9:.1f} GB/s; {cpu_description()}")
    print(f"peak RSS: snapkv {peak_rss() / 2**30:.2f} GiB (its whole bench), "
          f"llama.cpp {theirs['peak_rss_bytes'] / 2**30:.2f} GiB; the file {Path(gguf).stat().st_size / 2**30:.2f} GiB")
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
