"""How good the citations are, and which way of pooling the answer's attention makes them best.

One script, one subcommand per study (each says what it measures with --help):

    accuracy   how often the top citation states the answer's fact, and what citing costs
    sweep      which layers, heads and pooling make the best citations

    .venv/bin/python benchmarks/citations.py SUBCOMMAND [OPTIONS]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from itertools import product
from pathlib import Path

import torch

from snapkv.citing.attention import answer_attention
from snapkv.citing.passages import document_passages
from snapkv.compression.config import DEFAULTS
from snapkv.engine.models import load_model
from snapkv.io.documents import Document
from snapkv.io.facts import fact_found
from snapkv.measure.fidelity import load_documents
from snapkv.measure.studies import run_study
from snapkv.session import Session

ACCURACY_DOC = """How often a cited answer's top citation is the sentence that states the fact, and what citing costs.

Every question of the fidelity documents (snapkv/io/data/fidelity: 17 documents, 431 questions on prominent and
secondary figures, names and dates) is answered as `snapkv ask --cite` answers it (default settings, greedy, the
cache saved and loaded back from a file as the store serves it), and cited through the library (Session.cite).
For the answers that state the expected fact (snapkv.io.facts.fact_found), the top citation is right where it
states the fact too. The time to cite is set against the time to answer.

    .venv/bin/python benchmarks/citations.py accuracy [--model M] [--documents N] [--json OUT]
"""


def run_accuracy(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=ACCURACY_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=0, help="only the first N documents (0: all)")
    parser.add_argument("--model", help="the model (default: the embedded one)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (64: a sentence or two)")
    parser.add_argument("--json", help="write every cited answer here")
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    session = Session(loaded, DEFAULTS)
    documents = load_documents()[: args.documents or None]
    rows, started = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for fact_document in documents:
            path = Path(folder) / f"{fact_document.name}.snapkv"
            session.save(session.prepare(Document(fact_document.text)), path)
            prepared = session.load_file(path, check_sources=False)
            for question in fact_document.questions:
                stream = session.ask(prepared, question.question, max_new_tokens=args.max_tokens)
                text = "".join(stream)
                found = fact_found(text, question.answer)
                citations = session.cite(prepared, stream) if found else []
                result = stream.result
                row = {"document": fact_document.name, "question": question.question, "expected": question.answer,
                       "detail": question.detail, "answer": text, "found": found,
                       "answer_seconds": result.ttft_seconds + result.decode_seconds,
                       "cite_seconds": result.cite_seconds, "citations": [c.to_dict() for c in citations],
                       "top_right": bool(citations) and fact_found(citations[0].text, question.answer),
                       "any_right": any(fact_found(c.text, question.answer) for c in citations),
                       "tokens": prepared.tokens}
                rows.append(row)
                if found:
                    mark = "right" if row["top_right"] else "WRONG"
                    print(f"{mark} {fact_document.name}: {question.question!r} -> "
                          f"{citations[0].text[:70] if citations else None!r}", file=sys.stderr, flush=True)
    cited = [r for r in rows if r["found"]]
    top = sum(r["top_right"] for r in cited)
    any_right = sum(r["any_right"] for r in cited)
    cite_seconds = [r["cite_seconds"] for r in cited]
    answer_seconds = [r["answer_seconds"] for r in cited]
    secondary = [r for r in cited if r["detail"] == "secondary"]
    print(f"{len(rows)} questions on {len(documents)} documents ({min(r['tokens'] for r in rows)}-"
          f"{max(r['tokens'] for r in rows)} tokens); {len(cited)} answers state the expected fact")
    print(f"top citation states it: {top}/{len(cited)} = {top / len(cited):.1%} (secondary details "
          f"{sum(r['top_right'] for r in secondary)}/{len(secondary)}); any citation: {any_right}/{len(cited)} = "
          f"{any_right / len(cited):.1%}; citations per answer {statistics.mean(len(r['citations']) for r in cited):.2f}")
    print(f"time to cite: median {statistics.median(cite_seconds):.3f} s (mean {statistics.mean(cite_seconds):.3f}, "
          f"max {max(cite_seconds):.3f}); to answer: median {statistics.median(answer_seconds):.3f} s; "
          f"{time.perf_counter() - started:.0f} s in all")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


SWEEP_DOC = """Which layers, heads and pooling make the best citations: every way measured on the same answers.

Each question of the fidelity documents (snapkv/io/data/fidelity) is answered as `snapkv ask` answers it (default
settings, greedy); for the answers that state the expected fact, the answer's attention over the document is taken
per layer and head (snapkv.citing.attention) and summed (and maxed) per passage. A way of pooling is then judged by
how often its top passage states the fact. The documents are split in two halves: ways are ranked on one half
(tune) and reported on the other (check) as well, so that a choice fitted to one half shows on the other.

    .venv/bin/python benchmarks/citations.py sweep [--model M] [--documents N] [--json OUT]
"""


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


def run_sweep(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=SWEEP_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=0, help="only the first N documents (0: all)")
    parser.add_argument("--model", help="the model (default: the embedded one)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args(argv)
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


STUDIES = {"accuracy": run_accuracy, "sweep": run_sweep}


if __name__ == "__main__":
    run_study(STUDIES, __doc__)
