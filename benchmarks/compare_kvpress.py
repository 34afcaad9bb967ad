"""Peer checks against NVIDIA kvpress on the embedded model, one run, same machine, side by side.

kvpress pins transformers < 5.3, so it lives in its own virtual environment; this script drives it as a
subprocess.

    python3 -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install "torch==2.13.0+cpu" kvpress==0.5.5
    .venv/bin/python benchmarks/compare_kvpress.py --kvpress-python /tmp/kvpress-venv/bin/python snapkv
    .venv/bin/python benchmarks/compare_kvpress.py --kvpress-python /tmp/kvpress-venv/bin/python kvzip --keep 0.5

snapkv: our SnapKV against kvpress's SnapKVPress at the same window, kernel, pooling and ratio: per layer and
KV head, the share of kept positions both choose (recovered the same way on both sides: every kept key
vector is matched to the position whose key it equals in the uncompressed cache), and the prefill+compress
seconds of each (best of --repeats).

kvzip: our reconstruction tier against kvpress's KVzipPress at the same kept share, on the same documents
and questions (needles at several lengths and depths, and one document with several facts): answers found,
and the seconds to prefill and choose what to keep. Ours is shown answering from the tier alone (as
KVzipPress does) and with query-aware SnapKV on top (snapkv's default), and snapkv's default stored-tier
method (pseudo-question) at the same share beside it; all at 16 bits, so only the choice of positions differs. kvpress masks the dropped pairs
(no memory saved) and budgets them globally over layers and heads; ours drops them, the same count per head.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def kept_positions(full_keys, kept_keys):
    """Per head, the positions of `kept_keys` rows in `full_keys`. full: (heads, n, d), kept: (heads, k, d)."""
    import torch

    positions = []
    for head in range(full_keys.shape[0]):
        distance = torch.cdist(kept_keys[head].float(), full_keys[head].float())  # (k, n)
        positions.append(sorted(distance.argmin(dim=1).tolist()))
    return positions


def kvpress_side(args) -> None:
    """Runs in the kvpress environment: prefill with SnapKVPress, report kept positions and seconds."""
    import torch
    from kvpress import SnapKVPress
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(args.threads)
    ids = torch.tensor(json.loads(Path(args.ids).read_text())).unsqueeze(0)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    press = SnapKVPress(compression_ratio=args.ratio, window_size=args.window, kernel_size=args.kernel)
    with torch.no_grad():
        full = DynamicCache()
        model.model(ids, past_key_values=full, use_cache=True)
        seconds = []
        for _ in range(args.repeats):
            cache = DynamicCache()
            started = time.perf_counter()
            with press(model):
                model.model(ids, past_key_values=cache, use_cache=True)
            seconds.append(time.perf_counter() - started)
    layers = [kept_positions(full.layers[i].keys[0], cache.layers[i].keys[0]) for i in range(len(cache.layers))]
    Path(args.out).write_text(json.dumps({"positions": layers, "seconds": min(seconds)}))


def kvzip_side(args) -> None:
    """Runs in the kvpress environment: each document prefilled and compressed with KVzipPress, each question
    answered; reports answers and seconds per pipeline call."""
    import torch
    from kvpress import KVzipPress
    from transformers import pipeline

    torch.set_num_threads(args.threads)
    documents = json.loads(Path(args.ids).read_text())
    pipe = pipeline("kv-press-text-generation", model=args.model_dir, device="cpu",
                    dtype=getattr(torch, args.dtype))
    press = KVzipPress(compression_ratio=1 - args.keep)
    results = []
    for document in documents:
        answers, seconds = [], []
        for question, prefix in document["questions"]:
            started = time.perf_counter()
            output = pipe(document["context"], question=question, answer_prefix=prefix, press=press,
                          max_new_tokens=10)
            seconds.append(time.perf_counter() - started)
            answers.append(output["answer"])
        results.append({"answers": answers, "seconds": seconds})
    Path(args.out).write_text(json.dumps(results))


def kvzip_main(args) -> None:
    """Our side of the kvzip comparison, then theirs in a subprocess, then the table."""
    import statistics

    import torch

    from snapkv.compression.config import DEFAULTS, SnapKVConfig
    from snapkv.io.documents import Document
    from snapkv.measure.evaluation import multi_fact_document
    from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
    from snapkv.engine.models import load_model, resolve_model_source
    from snapkv.session import Session
    from snapkv.base.sizes import parse_sizes

    torch.set_num_threads(args.threads)
    loaded = load_model()
    documents = []  # {"context", "questions": [(question, prefix)], "expected": [number]}
    for length in parse_sizes(args.lengths, name="--lengths"):
        for depth in parse_sizes(args.depths, name="--depths", minimum=0):
            number = str(10000 + (length * 7 + depth * 131) % 89999)
            text = build_haystack(loaded.tokenizer, filler_text(), length, depth / 100, number).text
            documents.append({"name": f"needle {length}/{depth}%", "context": text,
                              "questions": [(NEEDLE_QUESTION, NEEDLE_ANSWER_PREFIX)], "expected": [number]})
    text, facts = multi_fact_document(loaded.tokenizer, filler_text(), parse_sizes(args.multi_tokens)[0], args.facts)
    documents.append({"name": "multi", "context": text, "questions": [(f.question, f.answer_prefix) for f in facts],
                      "expected": [f.number for f in facts]})
    ours = {}  # method -> per document {"seconds", "tier_seconds", "tokens", "tier": [found], "tier+snapkv": [found]}
    for method in ("reconstruction", DEFAULTS.store_method):
        session = Session(loaded, SnapKVConfig(store_keep=args.keep, store_bits=16, store_method=method))
        ours[method] = []
        for document in documents:
            prepared = session.prepare(Document(document["context"]), measure=True)
            found = {"tier": [], "tier+snapkv": []}
            for (question, prefix), expected in zip(document["questions"], document["expected"]):
                for name, answering in (("tier", prepared.answering_with(None)), ("tier+snapkv", prepared)):
                    text = "".join(session.ask(answering, question, answer_prefix=prefix, max_new_tokens=10))
                    found[name].append(expected in text)
            ours[method].append({"seconds": prepared.prefill_seconds, "tier_seconds": prepared.tier_seconds,
                                 "tokens": prepared.tokens, **found})
    with tempfile.TemporaryDirectory() as folder:
        docs_file, out_file = Path(folder) / "docs.json", Path(folder) / "kvzip.json"
        docs_file.write_text(json.dumps(documents))
        subprocess.run([args.kvpress_python, __file__, "--side", "kvzip", "--ids", str(docs_file),
                        "--model-dir", resolve_model_source(None)[1], "--out", str(out_file), "--keep", str(args.keep),
                        "--dtype", str(loaded.dtype).replace("torch.", ""), "--threads", str(args.threads)],
                       check=True)
        theirs = json.loads(out_file.read_text())
    print(f"{loaded.name}, {str(loaded.dtype).replace('torch.', '')}, keep {args.keep:.0%} of the context, 16-bit")
    print(f"{'document':<18}{'tokens':>7}{'recon':>8}{'recon+SnapKV':>14}{'pq+SnapKV':>11}{'kvpress KVzip':>15}"
          f"{'recon s (tier s)':>18}{'pq s (tier s)':>15}{'kvpress s':>11}")
    recon, pseudo = ours["reconstruction"], ours[DEFAULTS.store_method]
    totals = {"recon": 0, "recon+snapkv": 0, "pq+snapkv": 0, "kvzip": 0, "questions": 0}
    for document, mine, pq, their in zip(documents, recon, pseudo, theirs):
        kvzip_found = [expected in answer for expected, answer in zip(document["expected"], their["answers"])]
        counts = {"recon": sum(mine["tier"]), "recon+snapkv": sum(mine["tier+snapkv"]),
                  "pq+snapkv": sum(pq["tier+snapkv"]), "kvzip": sum(kvzip_found)}
        for key, value in counts.items():
            totals[key] += value
        count = len(kvzip_found)
        totals["questions"] += count
        print(f"{document['name']:<18}{mine['tokens']:>7}{counts['recon']:>6}/{count}{counts['recon+snapkv']:>12}/{count}"
              f"{counts['pq+snapkv']:>9}/{count}{counts['kvzip']:>13}/{count}"
              f"{mine['seconds']:>10.2f} ({mine['tier_seconds']:.2f}){pq['seconds']:>8.2f} ({pq['tier_seconds']:.2f})"
              f"{statistics.median(their['seconds']):>11.2f}")
    print(f"found of {totals['questions']}: snapkv reconstruction tier {totals['recon']}, with per-question SnapKV "
          f"{totals['recon+snapkv']}; pseudo-question tier with per-question SnapKV {totals['pq+snapkv']}; "
          f"kvpress KVzipPress {totals['kvzip']}")
    print("seconds: ours = prefill + choosing the tier, once per document; kvpress = one pipeline call (prefill + "
          "KVzip scoring + a 10-token answer), median over the document's questions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", nargs="?", default="snapkv", choices=["snapkv", "kvzip"])
    parser.add_argument("--kvpress-python", help="python of the environment that has kvpress")
    parser.add_argument("--keep", type=float, default=0.5, help="kvzip: share of the context kept")
    parser.add_argument("--lengths", default="2k,4k,7k", help="kvzip: needle document lengths")
    parser.add_argument("--depths", default="10,50,90", help="kvzip: needle depths in percent")
    parser.add_argument("--multi-tokens", default="4k", help="kvzip: length of the many-facts document")
    parser.add_argument("--facts", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--ratio", type=float, default=0.75, help="share of positions dropped (kvpress's compression_ratio)")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--kernel", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--side", default="snapkv", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "kvpress":
        kvpress_side(args)
        return
    if args.side == "kvzip":
        kvzip_side(args)
        return
    if args.check == "kvzip":
        kvzip_main(args)
        return

    import torch

    from snapkv.compression.config import SnapKVConfig
    from snapkv.io.documents import Document
    from snapkv.io.haystack import build_haystack, filler_text
    from snapkv.engine.models import load_model, resolve_model_source
    from snapkv.session import Session

    torch.set_num_threads(args.threads)
    loaded = load_model(dtype="float32", device="cpu")
    document = Document(build_haystack(loaded.tokenizer, filler_text(), args.tokens, 0.5, "48613").text)
    full_session = Session(loaded, None)
    prompt = full_session.prompt(document, max_tokens=args.tokens)  # both sides compress these very ids
    ids, n = prompt.ids, prompt.tokens
    budget = int(n * (1 - args.ratio))
    session = Session(loaded, SnapKVConfig(budget=budget, window=args.window, kernel=args.kernel, pooling="avg",
                                           query_aware=False))
    full = full_session.prepare(prompt).cache
    runs = [session.prepare(prompt, measure=True) for _ in range(args.repeats)]
    ours, seconds = runs[-1].cache, [run.prefill_seconds for run in runs]

    with tempfile.TemporaryDirectory() as folder:
        ids_file, out_file = Path(folder) / "ids.json", Path(folder) / "kvpress.json"
        ids_file.write_text(json.dumps(ids.tolist()))
        subprocess.run([args.kvpress_python, __file__, "--side", "kvpress", "--ids", str(ids_file),
                        "--model-dir", resolve_model_source(None)[1], "--out", str(out_file),
                        "--ratio", str(args.ratio), "--window", str(args.window), "--kernel", str(args.kernel),
                        "--repeats", str(args.repeats), "--threads", str(args.threads)], check=True)
        theirs = json.loads(out_file.read_text())

    agreements = []
    for layer, their_layer in enumerate(theirs["positions"]):
        # our positions come from the engine; recover them from keys too, exactly as on their side
        mine = kept_positions(full.keys[layer], ours.keys[layer])
        assert mine == ours.positions[layer].tolist(), "key matching disagrees with the engine's positions"
        for head, their_head in enumerate(their_layer):
            agreements.append(len(set(mine[head]) & set(their_head)) / max(len(their_head), 1))
    kept_theirs = len(theirs["positions"][0][0])
    print(f"{n} tokens, ratio {args.ratio}, window {args.window}, kernel {args.kernel}, avg pooling: "
          f"kept per head snapkv {budget}, kvpress {kept_theirs}")
    print(f"agreement of kept positions per layer and head: mean {sum(agreements) / len(agreements):.4f}, "
          f"min {min(agreements):.4f} over {len(agreements)} heads")
    print(f"prefill+compress seconds: snapkv {min(seconds):.2f}, kvpress {theirs['seconds']:.2f} "
          f"(ours/theirs {min(seconds) / theirs['seconds']:.3f})")


if __name__ == "__main__":
    sys.exit(main())
