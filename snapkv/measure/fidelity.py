"""Fidelity: do answers keep their facts when the cache is stored in fewer bits, or cut per question?

Two comparisons, each greedy answer against a reference answer to the same question:

    storage      a stored tier (the whole prompt in some bits) against the 16-bit cache, both cut per question
                 to the same budget: only what the file stores differs
    compression  the 16-bit cache cut per question to a budget against the full cache (no cut)

Per question: the changed facts (the numbers and capitalised names of the reference's first sentence that the
other answer lacks or alters: snapkv.io.facts), exact agreement of the first sentence, and for each side whether
the expected fact is found. Data: documents of prose with many facts and questions on the prominent and the
secondary detail (snapkv/io/data/fidelity: a .txt and a .json of questions each), plus the needle grid. Every
tier of a document is saved to a file and loaded back, and all its questions are asked of that one file, as a
user would. Measurements only: dataclasses out, nothing printed.
"""

import json
import random
import tempfile
import time
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Callable

from snapkv.base.bits import Bits
from snapkv.compression.config import DEFAULTS, SnapKVConfig
from snapkv.engine.models import LoadedModel
from snapkv.io.documents import Document
from snapkv.io.facts import compare, fact_found, first_sentence, how_changed, sentence_complete
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.session import PreparedDocument, Session

MAX_ANSWER_TOKENS = 64  # a first sentence is shorter than this; an answer stops where its first sentence ends


@dataclass(frozen=True)
class Question:
    question: str
    answer: str                  # the expected fact, as the document writes it
    kind: str = "number"         # decimal, number, date, code, name, needle
    detail: str = "prominent"    # prominent, or secondary (a second figure in the sentence, a subordinate detail)
    answer_prefix: str = ""      # text that starts the answer (the needle's), none for the documents' questions


@dataclass(frozen=True)
class FactDocument:
    name: str
    text: str
    questions: tuple[Question, ...]


def load_documents(folder: Path | None = None, names: list[str] | None = None) -> list[FactDocument]:
    """The documents of `folder` (default: the package's own set), each NAME.txt with NAME.json of questions
    ({"questions": [{"question", "answer", "kind", "detail"}]}), in name order; `names` picks some."""
    root = Path(folder) if folder is not None else Path(str(resources.files("snapkv.io").joinpath("data", "fidelity")))
    documents = []
    for spec in sorted(root.glob("*.json")):
        if names and spec.stem not in names:
            continue
        data = json.loads(spec.read_text(encoding="utf-8"))
        questions = tuple(Question(q["question"], q["answer"], q.get("kind", "number"), q.get("detail", "prominent"))
                          for q in data["questions"])
        documents.append(FactDocument(spec.stem, spec.with_suffix(".txt").read_text(encoding="utf-8"), questions))
    missing = set(names or ()) - {d.name for d in documents}
    if missing:
        raise ValueError(f"no fidelity document named {', '.join(sorted(missing))} in {root}")
    return documents


def needle_documents(tokenizer, lengths: list[int], depths: list[float]) -> list[FactDocument]:
    """The needle grid as documents of one question each: a five-digit number at each depth of each length."""
    documents = []
    for li, length in enumerate(lengths):
        for di, depth in enumerate(depths):
            number = str(random.Random(7919 * li + di).randrange(10000, 99999))
            haystack = build_haystack(tokenizer, filler_text(), length, depth, number)
            question = Question(NEEDLE_QUESTION, number, "needle", "prominent", NEEDLE_ANSWER_PREFIX)
            documents.append(FactDocument(f"needle-{length}-{round(depth * 100)}", haystack.text, (question,)))
    return documents


# ------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Setting:
    """One way of answering: a stored tier's bits and a per-question budget (None: the full cache, no cut)."""

    bits: Bits
    budget: int | None

    @property
    def name(self) -> str:
        return "full" if self.budget is None else f"{self.bits} @{self.budget}"

    def config(self, base: SnapKVConfig) -> SnapKVConfig:
        return replace(base, store_bits=self.bits, store_keep=None, store_budget=None,
                       budget=self.budget or base.budget, query_aware=True)


FULL = Setting(Bits(16), None)


def settings_for(tiers: list[Bits], budget: int, budgets: list[int]) -> list[Setting]:
    """The full cache, the 16-bit cache at each budget (compression), each tier at `budget` (storage)."""
    wanted = [FULL, *(Setting(Bits(16), b) for b in budgets), Setting(Bits(16), budget),
              *(Setting(t, budget) for t in tiers)]
    return list(dict.fromkeys(wanted))


# ------------------------------------------------------------------------------------------ results


@dataclass
class Answer:
    text: str           # up to the end of its first sentence
    found: bool         # the expected fact is in the first sentence
    seconds: float


@dataclass
class Comparison:
    """One setting's answers against a reference setting's, question by question."""

    setting: str
    reference: str
    questions: int = 0
    agreed: int = 0                  # first sentence identical
    changed: int = 0                 # answers with a number or name of the reference lacking or altered
    changed_right: int = 0           # of those, answers whose reference stated the expected fact (not a guess)
    found: int = 0                   # expected facts found by this setting
    reference_found: int = 0
    lost: int = 0                    # found by the reference, not by this setting
    gained: int = 0                  # found by this setting, not by the reference
    kinds: dict = field(default_factory=dict)   # how an answer changed -> count (snapkv.io.facts.how_changed)
    examples: list = field(default_factory=list)  # changed answers: document, question, reference, answer, changes
    file_bytes: int = 0              # summed over the documents (storage comparisons)
    reference_bytes: int = 0

    @property
    def agreement(self) -> float:
        return self.agreed / self.questions if self.questions else 0.0

    @property
    def changed_share(self) -> float:
        return self.changed / self.questions if self.questions else 0.0

    @property
    def bytes_ratio(self) -> float:
        """How many times smaller than the reference's files (0 where not measured)."""
        return self.reference_bytes / self.file_bytes if self.file_bytes else 0.0

    def to_dict(self) -> dict:
        return {"setting": self.setting, "reference": self.reference, "questions": self.questions,
                "agreed": self.agreed, "agreement": self.agreement, "changed": self.changed,
                "changed_share": self.changed_share, "changed_right": self.changed_right, "found": self.found,
                "reference_found": self.reference_found,
                "lost": self.lost, "gained": self.gained, "kinds": self.kinds, "file_bytes": self.file_bytes,
                "reference_bytes": self.reference_bytes, "bytes_ratio": self.bytes_ratio, "examples": self.examples}


@dataclass
class FidelityResult:
    model: str
    dtype: str
    budget: int
    settings: list[str]
    documents: list[dict] = field(default_factory=list)  # name, tokens, per setting: file bytes, answers
    seconds: float = 0.0
    storage: list[Comparison] = field(default_factory=list)
    compression: list[Comparison] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"model": self.model, "dtype": self.dtype, "budget": self.budget, "settings": self.settings,
                "seconds": self.seconds, "storage": [c.to_dict() for c in self.storage],
                "compression": [c.to_dict() for c in self.compression], "documents": self.documents}


def compare_settings(documents: list[dict], setting: str, reference: str) -> Comparison:
    """`setting`'s answers against `reference`'s over every question of every document."""
    result = Comparison(setting, reference)
    for document in documents:
        ours, theirs = document["answers"][setting], document["answers"][reference]
        result.file_bytes += document["file_bytes"].get(setting, 0)
        result.reference_bytes += document["file_bytes"].get(reference, 0)
        for question, answer, reference_answer in zip(document["questions"], ours, theirs):
            result.questions += 1
            result.found += answer["found"]
            result.reference_found += reference_answer["found"]
            result.lost += reference_answer["found"] and not answer["found"]
            result.gained += answer["found"] and not reference_answer["found"]
            how = how_changed(reference_answer["text"], answer["text"], question["question"])
            result.kinds[how] = result.kinds.get(how, 0) + 1
            result.agreed += how == "same"
            changes = compare(reference_answer["text"], answer["text"], question["question"])
            if changes or (reference_answer["found"] and not answer["found"]):
                result.changed += bool(changes)
                result.changed_right += bool(changes) and reference_answer["found"]
                result.examples.append({
                    "document": document["name"], "question": question["question"], "expected": question["answer"],
                    "reference": reference_answer["text"], "answer": answer["text"],
                    "changes": [c.describe() for c in changes], "lost": reference_answer["found"] and not answer["found"]})
    return result


def summarize(result: FidelityResult, settings: list[Setting]) -> None:
    """Fill result.storage (each tier against 16 bits at the same budget) and result.compression (16 bits at each
    budget against the full cache)."""
    sixteen = Setting(Bits(16), result.budget).name
    result.storage = [compare_settings(result.documents, s.name, sixteen)
                      for s in settings if s.budget == result.budget and s.bits != 16]
    result.compression = [compare_settings(result.documents, s.name, FULL.name)
                          for s in settings if s.budget is not None and s.bits == 16]


# ------------------------------------------------------------------------------------------ running


def _ask(session: Session, prepared: PreparedDocument, question: Question) -> Answer:
    """The greedy answer, generated up to the end of its first sentence."""
    started = time.perf_counter()
    stream = session.ask(prepared, question.question, answer_prefix=question.answer_prefix,
                         max_new_tokens=MAX_ANSWER_TOKENS)
    pieces = iter(stream)
    text = question.answer_prefix
    try:
        for piece in pieces:
            text += piece
            if sentence_complete(text):
                break
    finally:
        pieces.close()  # the answer's cache copy is dropped; the loaded cache is never changed
    text = first_sentence(text)
    return Answer(text, fact_found(text, question.answer), time.perf_counter() - started)


Progress = Callable[[str], None]


def run_fidelity(loaded: LoadedModel, documents: list[FactDocument], tiers: list[Bits], budget: int = DEFAULTS.budget,
                 budgets: list[int] | None = None, base: SnapKVConfig = DEFAULTS,
                 on_progress: Progress | None = None, on_document: Callable[[dict], None] | None = None) -> FidelityResult:
    """Every question of every document answered under each setting (snapkv.measure.fidelity.settings_for).

    Per document the whole prompt is prefilled once into a 16-bit cache; each tier is made from it (no new
    prefill), saved to a file, loaded back, and every question asked of that file.
    on_document: called with each document's record once its answers are in (to write partial results).
    """
    settings = settings_for(tiers, budget, budgets or [budget])
    result = FidelityResult(loaded.name, str(loaded.dtype).removeprefix("torch."), budget, [s.name for s in settings])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="snapkv-fidelity-") as folder:
        for number, fact_document in enumerate(documents, 1):
            record = {"name": fact_document.name, "questions": [q.__dict__ for q in fact_document.questions],
                      "answers": {}, "file_bytes": {}, "seconds": {}}
            whole_session = Session(loaded, FULL.config(base))
            if on_progress:
                on_progress(f"document {number}/{len(documents)} {fact_document.name}: prefill")
            whole = whole_session.prepare(Document(fact_document.text))
            record["tokens"] = whole.tokens
            by_bits: dict = {}
            for setting in settings:
                session = Session(loaded, setting.config(base))
                if setting.bits not in by_bits:
                    tier_started = time.perf_counter()
                    derived = whole if setting.bits == 16 else session.derive(whole)
                    path = Path(folder) / f"{number}-{len(by_bits)}.snapkv"
                    session.save(derived, path)
                    by_bits[setting.bits] = (session.load_file(path, check_sources=False), derived.file_bytes,
                                             time.perf_counter() - tier_started)
                    path.unlink()
                loaded_tier, file_bytes, tier_seconds = by_bits[setting.bits]
                per_question = None if setting.budget is None else setting.config(base).cut
                prepared = loaded_tier.answering_with(per_question)
                answers = []
                for index, question in enumerate(fact_document.questions):
                    if on_progress:
                        on_progress(f"document {number}/{len(documents)} {fact_document.name}: {setting.name}, "
                                    f"question {index + 1}/{len(fact_document.questions)}")
                    answers.append(_ask(session, prepared, question).__dict__)
                record["answers"][setting.name] = answers
                record["file_bytes"][setting.name] = file_bytes
                record["seconds"][setting.name] = tier_seconds + sum(a["seconds"] for a in answers)
            result.documents.append(record)
            if on_document:
                on_document(record)
    result.seconds = time.perf_counter() - started
    summarize(result, settings)
    return result
