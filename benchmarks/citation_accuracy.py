"""How often a cited answer's top citation is the sentence that states the fact, and what citing costs.

Every question of the fidelity documents (snapkv/io/data/fidelity: 17 documents, 431 questions on prominent and
secondary figures, names and dates) is answered as `snapkv ask --cite` answers it (default settings, greedy, the
cache saved and loaded back from a file as the store serves it), and cited through the library (Session.cite).
For the answers that state the expected fact (snapkv.io.facts.fact_found), the top citation is right where it
states the fact too. The time to cite is set against the time to answer.

    .venv/bin/python benchmarks/citation_accuracy.py [--model M] [--documents N] [--json OUT]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from snapkv.compression.config import DEFAULTS
from snapkv.engine.models import load_model
from snapkv.io.documents import Document
from snapkv.io.facts import fact_found
from snapkv.measure.fidelity import load_documents
from snapkv.session import Session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=0, help="only the first N documents (0: all)")
    parser.add_argument("--model", help="the model (default: the embedded one)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (64: a sentence or two)")
    parser.add_argument("--json", help="write every cited answer here")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
