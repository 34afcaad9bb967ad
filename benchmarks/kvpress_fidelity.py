"""The fidelity questions of `snapkv eval fidelity`, answered with NVIDIA kvpress's presses, for a peer comparison.

kvpress pins transformers < 5.3, so it lives in its own virtual environment; this script drives it as a
subprocess (as benchmarks/compare_kvpress.py does):

    python3 -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install "torch==2.13.0+cpu" kvpress==0.5.5
    .venv/bin/python benchmarks/kvpress_fidelity.py --kvpress-python /tmp/kvpress-venv/bin/python \\
        --only annual_report,DOC2 --budgets 1024,2048 --presses snapkv,chunkkv,adakv,expected,kvzip -o results.json

What it measures: for each fidelity document (snapkv/io/data/fidelity, or --documents), the context ids and each
question's ids are made here by snapkv's own Prompter (the same chat template, system message, instruction and
tokenization as snapkv's answers), and handed to kvpress as ids. There, for each press and budget, the context is
prefilled once in float32 with the press active (as kvpress's pipeline does: the question is not in the window,
so the cut is query-agnostic, one per document), with compression_ratio = 1 - budget / context tokens (a budget
at or above the context cuts nothing: that setting's answers are the full cache's, and the record lists it under
"uncut"); then every question is asked of a copy of that cache: its ids at the positions after the whole
context, greedy decoding up to snapkv.measure.fidelity.MAX_ANSWER_TOKENS tokens or the model's end of turn
(<|im_end|>, eos). "kvpress full" asks the same questions of kvpress's own full cache (no press), so that both
sides can be checked to agree where nothing is cut. Back here each answer is decoded as snapkv decodes it and
scored with snapkv.io.facts.fact_found.

Presses (kvpress 0.5.5, defaults except the ratio):
    snapkv     SnapKVPress (window 64, kernel 5): the context's last 64 queries score the rest, per KV head
    chunkkv    ChunkKVPress(SnapKVPress, chunk_length=20): whole chunks of 20 tokens kept, scored by SnapKV
    adakv      AdaKVPress(SnapKVPress): SnapKV's scores, budgeted over all heads of a layer (masked, not dropped)
    expected   ExpectedAttentionPress: scores from the expected attention of future queries
    kvzip      KVzipPress: scores from reconstructing the context, budgeted over all layers (masked, not dropped);
               it measures the template's prefix from the model's template with the template's own system message
               (24 tokens for SmolLM2, against the 29 of snapkv's head), so its reconstruction starts a few tokens
               before the document, in snapkv's instruction
A budget is positions per KV head (the window included) for snapkv, chunkkv and expected; for adakv and kvzip
the same number of positions in all, shared unevenly among heads (and for kvzip among layers).

Out: JSON in the record format of snapkv's fidelity results (documents: {"name", "questions", "answers":
{setting: [{"text", "found", "seconds"}]}, "file_bytes": {}, "seconds": {setting: summed answer seconds},
"tokens", "prefill_seconds": {setting}, "kept": {setting: mean positions kept per KV head}, "uncut": [...]}),
with "model", "dtype", "settings", "system", "answer_tokens", "cpu", and "compression": each press's answers
compared with "kvpress full" by snapkv.measure.fidelity.compare_settings. Setting names: "kvpress full",
"kvpress snapkv @2048", "kvpress kvzip @25%". A press that fails is reported in "failures" and the others go on.
Answer seconds are the question's prefill and decoding, not the copy of the cache.
"""

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

PRESSES = ("snapkv", "chunkkv", "adakv", "expected", "kvzip")
FULL_SETTING = "kvpress full"


def setting_name(press: str, budget: int | None, share: float | None) -> str:
    return f"kvpress {press} @{budget}" if share is None else f"kvpress {press} @{share:.0%}"


# ------------------------------------------------------------------------------------------ kvpress side


def make_press(name: str, ratio: float):
    """kvpress's press of that name at `ratio` (share of positions dropped)."""
    from kvpress import AdaKVPress, ChunkKVPress, ExpectedAttentionPress, KVzipPress, SnapKVPress

    if name == "snapkv":
        return SnapKVPress(compression_ratio=ratio)
    if name == "chunkkv":
        return ChunkKVPress(press=SnapKVPress(compression_ratio=ratio), chunk_length=20)
    if name == "adakv":
        return AdaKVPress(press=SnapKVPress(compression_ratio=ratio))
    if name == "expected":
        return ExpectedAttentionPress(compression_ratio=ratio)
    if name == "kvzip":
        return KVzipPress(compression_ratio=ratio)
    raise ValueError(f"unknown press {name!r}: use {', '.join(PRESSES)}")


def ratio_for(tokens: int, budget: int | None, share: float | None) -> float:
    """compression_ratio that keeps `budget` positions of `tokens` (or the `share`); <= 0 where nothing is cut.
    Nudged down where float rounding would make kvpress keep one position fewer (it keeps int(n * (1 - ratio)))."""
    if share is not None:
        return 1.0 - share
    ratio = 1.0 - budget / tokens
    while ratio > 0 and int(tokens * (1 - ratio)) < budget:
        ratio -= 1e-12
    return ratio


def kept_per_head(model, cache) -> float:
    """Mean positions each KV head keeps of the context: the cache's length, less the positions masked by presses
    that mask instead of dropping (AdaKV, KVzip: the attention modules' masked_key_indices)."""
    layers = model.model.layers
    heads = model.config.num_key_value_heads
    total = 0
    for index, layer in enumerate(layers):
        length = cache.layers[index].keys.shape[2]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        total += length * heads - (len(masked[0]) if masked is not None else 0)
    return total / (len(layers) * heads)


def answer_ids(model, cache, question_ids: list[int], position: int, max_new_tokens: int,
               stop_ids: set[int]) -> list[int]:
    """Greedy answer ids (stop token left out): the question at positions from `position`, then one token a step."""
    import torch

    ids = torch.tensor([question_ids])
    positions = torch.arange(position, position + ids.shape[1]).unsqueeze(0)
    logits = model(input_ids=ids, past_key_values=cache, position_ids=positions, logits_to_keep=1).logits
    answer = []
    next_position = position + ids.shape[1]
    while True:
        token = int(logits[0, -1].argmax())
        if token in stop_ids:
            break
        answer.append(token)
        if len(answer) >= max_new_tokens:
            break
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                       position_ids=torch.tensor([[next_position]]), logits_to_keep=1).logits
        next_position += 1
    return answer


def kvpress_side(args) -> None:
    """Runs in the kvpress environment: every document prefilled under every press and budget, every question
    answered; one JSON line per document appended to --out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    from transformers.utils import logging as transformers_logging

    import kvpress

    torch.set_num_threads(args.threads)
    transformers_logging.disable_progress_bar()
    job = json.loads(Path(args.ids).read_text())
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    stop_ids = set()
    for source in (model.generation_config, model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        stop_ids.update([eos] if isinstance(eos, int) else list(eos or []))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        stop_ids.add(end_of_turn)
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    header = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else _version("kvpress"),
              "transformers": _version("transformers"), "torch": torch.__version__,
              "stop_ids": sorted(stop_ids), "threads": args.threads}
    out = Path(args.out)
    out.write_text(json.dumps({"header": header}) + "\n")

    def log(text: str) -> None:
        print(f"[kvpress] {text}", file=sys.stderr, flush=True)

    for number, document in enumerate(job["documents"], 1):
        context = torch.tensor([document["context"]])
        tokens = context.shape[1]
        record = {"name": document["name"], "answers": {}, "prefill_seconds": {}, "kept": {}, "uncut": [],
                  "failures": {}}
        wanted = [(FULL_SETTING, None, None)] + [
            (setting_name(press, budget, share), press, ratio_for(tokens, budget, share))
            for press in job["presses"] for budget, share in job["sizes"]]
        for name, press_name, ratio in wanted:
            if press_name is not None and ratio <= 0:
                record["uncut"].append(name)
                continue
            log(f"document {number}/{len(job['documents'])} {document['name']} ({tokens} tokens): {name}"
                + (f", ratio {ratio:.4f}" if ratio is not None else ""))
            try:
                cache = DynamicCache()
                press = make_press(press_name, ratio) if press_name is not None else None
                started = time.perf_counter()
                with torch.no_grad():
                    if press is None:
                        model.model(input_ids=context, past_key_values=cache, use_cache=True)
                    else:
                        with press(model):  # keyword input_ids: KVzipPress reads the context from them
                            model.model(input_ids=context, past_key_values=cache, use_cache=True)
                record["prefill_seconds"][name] = time.perf_counter() - started
                record["kept"][name] = kept_per_head(model, cache)
                answers = []
                for question in document["questions"]:
                    room = limit - tokens - len(question) if limit else args.answer_tokens
                    working = copy.deepcopy(cache)
                    started = time.perf_counter()
                    with torch.no_grad():
                        ids = answer_ids(model, working, question, tokens, min(args.answer_tokens, room), stop_ids)
                    answers.append({"ids": ids, "seconds": time.perf_counter() - started})
                record["answers"][name] = answers
            except Exception as error:  # one press failing leaves the others to run
                record["failures"][name] = f"{type(error).__name__}: {error}"
                log(f"{name} failed: {record['failures'][name]}\n{traceback.format_exc()}")
        with out.open("a") as stream:
            stream.write(json.dumps(record) + "\n")


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


# ------------------------------------------------------------------------------------------ our side


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvpress-python", help="python of the environment that has kvpress")
    parser.add_argument("--only", help="document names, comma-separated (default: all)")
    parser.add_argument("--documents", type=Path, help="a folder of NAME.txt + NAME.json (default: snapkv's own)")
    parser.add_argument("--budgets", default="1024,2048",
                        help="positions kept per KV head, or shares of the context like 25%% (comma-separated)")
    parser.add_argument("--presses", default=",".join(PRESSES), help=f"comma-separated, of {', '.join(PRESSES)}")
    parser.add_argument("--system", default=None, help="system message (default: snapkv's DEFAULT_SYSTEM)")
    parser.add_argument("--model-dir", help="the model folder (default: the embedded model, converted)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-o", "--output", type=Path, help="write the results here (JSON)")
    parser.add_argument("--side", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--answer-tokens", type=int, default=64, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "kvpress":
        kvpress_side(args)
        return 0
    if not args.kvpress_python:
        parser.error("--kvpress-python is needed: the python of the environment that has kvpress")

    import torch
    from transformers import AutoTokenizer

    from snapkv.compression.config import DEFAULT_SYSTEM
    from snapkv.engine.models import cpu_description, resolve_model_source
    from snapkv.engine.prompting import Prompter
    from snapkv.io.facts import fact_found
    from snapkv.io.streaming import TextStream
    from snapkv.measure.fidelity import MAX_ANSWER_TOKENS, compare_settings, load_documents, parse_cut_sizes
    from snapkv.session import QUESTION_ALLOWANCE

    torch.set_num_threads(1)  # only tokenizing here
    presses = [p.strip() for p in args.presses.split(",") if p.strip()]
    unknown = set(presses) - set(PRESSES)
    if unknown:
        parser.error(f"unknown press {', '.join(sorted(unknown))}: use {', '.join(PRESSES)}")
    sizes = [size for size in parse_cut_sizes(args.budgets) if size != (None, None)]
    system = DEFAULT_SYSTEM if args.system is None else args.system
    model_name, model_dir = (Path(args.model_dir).name, args.model_dir) if args.model_dir \
        else resolve_model_source(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompter = Prompter(tokenizer, system)
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    documents = load_documents(args.documents, names)

    config = json.loads((Path(model_dir) / "config.json").read_text())
    limit = int(config.get("max_position_embeddings") or 0)
    job = {"presses": presses, "sizes": sizes, "documents": []}
    for document in documents:
        context = prompter.context_ids(document.text).tolist()
        room = limit - prompter.overhead - QUESTION_ALLOWANCE
        if limit and len(context) - prompter.overhead > room:  # snapkv refuses it too (without --truncate)
            raise SystemExit(f"{document.name}: {len(context)} context tokens, more than {model_name} holds with "
                             "room for a question and answer")
        questions = [prompter.question_ids(q.question, q.answer_prefix).tolist() for q in document.questions]
        job["documents"].append({"name": document.name, "context": context, "questions": questions})

    settings = [FULL_SETTING] + [setting_name(p, b, s) for p in presses for b, s in sizes]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvpress-fidelity-") as folder:
        ids_file, out_file = Path(folder) / "job.json", Path(folder) / "answers.jsonl"
        ids_file.write_text(json.dumps(job))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        process = subprocess.run([args.kvpress_python, __file__, "--side", "kvpress", "--ids", str(ids_file),
                                  "--model-dir", model_dir, "--out", str(out_file), "--threads", str(args.threads),
                                  "--answer-tokens", str(MAX_ANSWER_TOKENS)], env=env)
        lines = [json.loads(line) for line in out_file.read_text().splitlines()] if out_file.exists() else []
    if not lines:
        print(f"the kvpress side ended with status {process.returncode} before writing anything", file=sys.stderr)
        return 1
    header, theirs = lines[0]["header"], lines[1:]

    result = {"model": model_name, "dtype": "float32", "settings": settings, "system": system,
              "answer_tokens": MAX_ANSWER_TOKENS, "cpu": cpu_description(), "threads": args.threads,
              "engine": f"kvpress {header['kvpress']}, transformers {header['transformers']}, "
                        f"torch {header['torch']}", "stop_ids": header["stop_ids"],
              "budgets": args.budgets, "presses": presses, "seconds": time.perf_counter() - started,
              "failures": {}, "compression": [], "documents": []}
    for document, sent, their in zip(documents, job["documents"], theirs):
        record = {"name": document.name, "questions": [q.__dict__ for q in document.questions], "answers": {},
                  "file_bytes": {}, "seconds": {}, "tokens": len(sent["context"]),
                  "prefill_seconds": their["prefill_seconds"], "kept": their["kept"], "uncut": their["uncut"]}
        for name, answers in their["answers"].items():
            scored = []
            for question, answer in zip(document.questions, answers):
                stream = TextStream(tokenizer)  # decoded as snapkv's answers are
                text = "".join(stream.add(token) for token in answer["ids"]) + stream.flush()
                text = question.answer_prefix + text
                scored.append({"text": text.strip(), "found": fact_found(text, question.answer),
                               "seconds": answer["seconds"]})
            record["answers"][name] = scored
            record["seconds"][name] = sum(a["seconds"] for a in scored)
        for name in their["uncut"]:  # nothing cut: the full cache's answers
            if FULL_SETTING in record["answers"]:
                record["answers"][name] = record["answers"][FULL_SETTING]
                record["seconds"][name] = record["seconds"][FULL_SETTING]
        for name, error in their["failures"].items():
            result["failures"].setdefault(name, []).append(f"{document.name}: {error}")
        result["documents"].append(record)

    complete = [s for s in settings if all(s in d["answers"] for d in result["documents"])]
    if FULL_SETTING in complete and result["documents"]:
        result["compression"] = [compare_settings(result["documents"], s, FULL_SETTING).to_dict()
                                 for s in complete if s != FULL_SETTING]
    if args.output:
        args.output.write_text(json.dumps(result, indent=1, ensure_ascii=False))

    questions = sum(len(d["questions"]) for d in result["documents"])
    print(f"{model_name}, float32, {result['engine']}, {len(result['documents'])} documents, {questions} questions")
    print(f"{'setting':<28}{'found':>8}{'agreed':>8}{'lost':>6}{'gained':>8}{'kept/head':>11}{'s/answer':>10}")
    by_setting = {c["setting"]: c for c in result["compression"]}
    for name in settings:
        if name not in complete:
            print(f"{name:<28}  failed or missing (see failures)")
            continue
        found = sum(a["found"] for d in result["documents"] for a in d["answers"][name])
        kept = [d["kept"].get(name, d["tokens"]) for d in result["documents"]]
        seconds = sum(d["seconds"][name] for d in result["documents"]) / max(questions, 1)
        comparison = by_setting.get(name)
        agreed, lost, gained = ((comparison["agreed"], comparison["lost"], comparison["gained"]) if comparison
                                else (questions, 0, 0))
        print(f"{name:<28}{found:>5}/{questions:<3}{agreed:>7}{lost:>6}{gained:>8}"
              f"{sum(kept) / len(kept):>11.1f}{seconds:>10.2f}")
    for name, errors in result["failures"].items():
        print(f"failed: {name}: {errors[0]}" + (f" (and {len(errors) - 1} more documents)" if len(errors) > 1 else ""))
    if process.returncode != 0:
        print(f"the kvpress side ended with status {process.returncode}; results above are partial", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
