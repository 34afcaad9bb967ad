"""Which layers, heads and pooling make the best citations: every way measured on the same answers.

Each question of the fidelity documents (snapkv/io/data/fidelity) is answered as `snapkv ask` answers it (default
settings, greedy); for the answers that state the expected fact, the answer's attention over the document is taken
per layer and head (snapkv.citing.attention) and summed (and maxed) per passage. A way of pooling is then judged by
how often its top passage states the fact. The documents are split in two halves: ways are ranked on one half
(tune) and reported on the other (check) as well, so that a choice fitted to one half shows on the other.

    .venv/bin/python benchmarks/citation_sweep.py [--model M] [--documents N] [--json OUT]
"""

import argparse
import json
import sys
import time
from itertools import product

import torch

from snapkv.citing.attention import answer_attention
from snapkv.citing.passages import document_passages
from snapkv.compression.config import DEFAULTS
from snapkv.engine.models import load_model
from snapkv.io.documents import Document
from snapkv.io.facts import fact_found
from snapkv.measure.fidelity import load_documents
from snapkv.session import Session


def collect(session: Session, documents, max_tokens: int, on_line) -> list[dict]:
    """Per answer that states its fact: per layer (heads, passages) attention sums and maxima, and which passages
    state the fact."""
    loaded = session.loaded
    records = []
    for number, fact_document in enumerate(documents):
        prepared = session.prepare(Document(fact_document.text))
        cache = prepared.cache
        passages = document_passages(loaded.tokenizer, cache.token_ids, cache.document, [])
        owner = torch.full((cache.original_length,), len(passages), dtype=torch.long)  # passage of each position
        for index, passage in enumerate(passages):
            owner[passage.positions.start:passage.positions.stop] = index
        lengths = torch.bincount(owner, minlength=len(passages) + 1)[:-1].float()
        for question in fact_document.questions:
            stream = session.ask(prepared, question.question, max_new_tokens=max_tokens)
            text = "".join(stream)
            if not fact_found(text, question.answer) or not stream.answer_ids:
                records.append({"document": number, "found": False})
                continue
            answer_ids = torch.tensor(stream.answer_ids, dtype=torch.long)
            fed = torch.cat([stream.question_ids, answer_ids[:-1]])
            sums, maxima = {}, {}

            def reduce(layer, summed, positions):  # (q_heads, held) each
                heads = summed.shape[0]
                by_position = torch.zeros(heads, cache.original_length).scatter_(1, positions.cpu(), summed.cpu())
                index = owner.expand(heads, -1)
                sums[layer] = torch.zeros(heads, len(passages) + 1).scatter_add_(1, index, by_position)[:, :-1]
                maxima[layer] = torch.zeros(heads, len(passages) + 1).scatter_reduce_(
                    1, index, by_position, "amax")[:, :-1]

            started = time.perf_counter()
            answer_attention(loaded.model, cache, fed, answer_ids.shape[0], reduce)
            seconds = time.perf_counter() - started
            layers = sorted(sums)
            records.append({
                "document": number, "found": True, "seconds": seconds,
                "sums": torch.stack([sums[i] for i in layers]),      # (layers, heads, passages)
                "maxima": torch.stack([maxima[i] for i in layers]),
                "lengths": lengths,
                "states": torch.tensor([fact_found(p.text, question.answer) for p in passages]),
            })
            on_line(f"{fact_document.name}: {question.question!r} -> {text.strip()[:60]!r} "
                    f"({seconds:.2f} s, {answer_ids.shape[0]} tokens)")
    return records


def score_of(record: dict, layers: slice | list[int], heads: str, passages: str) -> torch.Tensor:
    """(passages,) scores for one way of pooling."""
    table = record["maxima"] if passages == "max" else record["sums"]
    chosen = table[layers]  # (l, heads, passages)
    if heads == "max":
        per_layer = chosen.amax(dim=1)
    else:
        per_layer = chosen.mean(dim=1)
    pooled = per_layer.mean(dim=0)
    if passages == "mean":
        pooled = pooled / record["lengths"].clamp(min=1)
    return pooled


def accuracy(records: list[dict], layers, heads: str, passages: str) -> tuple[float, int]:
    judged = [r for r in records if r["found"] and bool(r["states"].any())]
    right = sum(bool(r["states"][int(score_of(r, layers, heads, passages).argmax())]) for r in judged)
    return (right / len(judged) if judged else 0.0), len(judged)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=0, help="only the first N documents (0: all)")
    parser.add_argument("--model", help="the model (default: the embedded one)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    loaded = load_model(args.model)
    session = Session(loaded, DEFAULTS)
    documents = load_documents()
    if args.documents:
        documents = documents[: args.documents]
    started = time.perf_counter()
    records = collect(session, documents, args.max_tokens, lambda line: print(line, file=sys.stderr, flush=True))
    layers_total = next(r["sums"].shape[0] for r in records if r["found"])
    thirds = [layers_total * i // 3 for i in range(4)]
    layer_sets = {"all": slice(None), "first third": slice(0, thirds[1]), "middle third": slice(thirds[1], thirds[2]),
                  "last third": slice(thirds[2], None), "second half": slice(layers_total // 2, None),
                  "first half": slice(0, layers_total // 2),
                  **{f"layer {i}": [i] for i in range(layers_total)}}
    tune = [r for r in records if r["document"] % 2 == 0]
    check = [r for r in records if r["document"] % 2 == 1]
    rows = []
    for (name, layers), heads, passages in product(layer_sets.items(), ("mean", "max"), ("sum", "max", "mean")):
        rows.append({"layers": name, "heads": heads, "passages": passages,
                     "tune": accuracy(tune, layers, heads, passages)[0],
                     "check": accuracy(check, layers, heads, passages)[0],
                     "all": accuracy(records, layers, heads, passages)[0]})
    rows.sort(key=lambda row: -row["tune"])
    found = [r for r in records if r["found"]]
    print(f"{len(records)} questions, {len(found)} answers state their fact "
          f"({accuracy(records, slice(None), 'mean', 'sum')[1]} with a passage that states it); "
          f"{time.perf_counter() - started:.0f} s; the attention pass {sum(r['seconds'] for r in found) / len(found):.3f} s "
          "per answer on average")
    print(f"{'layers':<14} {'heads':<5} {'passages':<8} {'tune':>6} {'check':>6} {'all':>6}")
    for row in rows[:40]:
        print(f"{row['layers']:<14} {row['heads']:<5} {row['passages']:<8} {row['tune']:6.1%} {row['check']:6.1%} "
              f"{row['all']:6.1%}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
