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
import math
import random
import re
import tempfile
import time
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Callable

from snapkv.base.bits import Bits, parse_tier, tier_name
from snapkv.base.sizes import parse_size
from snapkv.compression.config import DEFAULTS, ENGINE_CHOICES, Cut, SnapKVConfig
from snapkv.engine.models import LoadedModel
from snapkv.io.documents import Document
from snapkv.io.facts import compare, fact_found, how_changed
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.session import PreparedDocument, Session

MAX_ANSWER_TOKENS = 64  # every answer is compared whole up to here, not only its first sentence


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


_SETTING_NAME = re.compile(
    r"(?:(full)|(\S+) @(\d+%?|\d+\.\d+%)(?: (?!(?:words|numbers|pyramid)\b)([a-z][\w-]*))?( words)?( numbers)?( pyramid)?(?: k(\d+))?)"
    r"(?: \[(\w+)\])?")

# what may follow a method's name in --cut-methods (snapkv+words+pyramid): the cut keeps words whole
# (Cut.whole_words), numbers with their neighbours too (Cut.numbers_with_neighbours), its budget differs by layer
# (Cut.pyramid)
CUT_FLAGS = ("words", "numbers", "pyramid")


def cut_method_parts(text: str) -> tuple[str, dict[str, bool]]:
    """"snapkv+words+pyramid" -> ("snapkv", {"words": True, "numbers": False, "pyramid": True}): the method's name
    and its CUT_FLAGS; ValueError for an unknown flag, or numbers without words."""
    name, *flags = text.strip().split("+")
    unknown = [flag for flag in flags if flag not in CUT_FLAGS]
    if unknown:
        raise ValueError(f"+{', +'.join(unknown)} after {name!r}: the flags are +{', +'.join(CUT_FLAGS)}")
    if "numbers" in flags and "words" not in flags:
        raise ValueError(f"{text.strip()}: +numbers goes with +words (numbers are kept whole with their neighbours)")
    return name, {flag: flag in flags for flag in CUT_FLAGS}


@dataclass(frozen=True)
class Setting:
    """One way of answering: a stored tier's bits and a per-question cut.

    stored: the stored tier keeps this share of the document's positions, ranked by the default store method (the
    pseudo-question probes; SnapKVConfig.store_keep), before it is rounded to `bits`; None: every position. Named
    "BITS~SHARE" ("8~45% @2048 words").
    budget: positions per KV head each question keeps; keep: or that share of the prompt instead; neither: the
    full cache, no cut. method: the per-question cut's method (snapkv.compression.methods), with `kernel` for its
    pooling where given. computation: another engine (torch, native, reference) or model dtype (bfloat16,
    float32) answering from the same file ("" the default): a second computation that should agree, for the noise
    floor.
    """

    bits: Bits
    budget: int | None
    keep: float | None = None
    method: str = "snapkv"
    kernel: int | None = None
    computation: str = ""
    words: bool = False  # the cut keeps words whole (Cut.whole_words)
    pyramid: bool = False  # the cut's budget differs by layer (Cut.pyramid)
    numbers: bool = False  # with words: numbers kept whole with their neighbours (Cut.numbers_with_neighbours)
    stored: float | None = None

    @property
    def full(self) -> bool:
        return self.budget is None and self.keep is None

    @property
    def name(self) -> str:
        if self.full:
            name = "full"
        else:
            name = f"{self.tier} @{self.budget}" if self.keep is None else f"{self.tier} @{self.keep:.0%}"
            name += "" if self.method == "snapkv" else f" {self.method}"
            name += " words" if self.words else ""
            name += " numbers" if self.numbers else ""
            name += " pyramid" if self.pyramid else ""
            name += "" if self.kernel is None else f" k{self.kernel}"
        return name + (f" [{self.computation}]" if self.computation else "")

    @property
    def tier(self) -> str:
        """The stored tier's name: its bits, and the share of the document it keeps where not all ("8~45%")."""
        return tier_name(self.bits, self.stored)

    @property
    def whole_16_bit(self) -> "Setting":
        """The same cut answered from the whole prompt's 16-bit file: what a stored tier is compared with."""
        return replace(self, bits=Bits(16), stored=None)

    @classmethod
    def parse(cls, name: str) -> "Setting":
        """The setting a name stands for ("full", "16/8 @4096", "16 @25% chunks k31", "full [torch]"); ValueError."""
        match = _SETTING_NAME.fullmatch(name.strip())
        if match is None:
            raise ValueError(f"not a fidelity setting's name: {name!r}")
        full, bits, size, method, words, numbers, pyramid, kernel, computation = match.groups()
        if full:
            return cls(Bits(16), None, computation=computation or "")
        budget, keep = (None, float(size[:-1]) / 100) if size.endswith("%") else (int(size), None)
        bits, stored = parse_tier(bits)
        return cls(bits, budget, keep, method or "snapkv", int(kernel) if kernel else None,
                   computation or "", bool(words), bool(pyramid), bool(numbers), stored)

    def config(self, base: SnapKVConfig) -> SnapKVConfig:
        return replace(base, store_bits=self.bits, store_keep=self.stored, store_budget=None,
                       budget=self.budget or base.budget, query_aware=True, method=self.method,
                       kernel=self.kernel or base.kernel, whole_words=self.words, pyramid=self.pyramid,
                       numbers_with_neighbours=self.numbers)

    def per_question(self, base: SnapKVConfig) -> Cut | None:
        """The cut each question makes (None: the full cache); a share is sized per document when answered."""
        if self.full:
            return None
        cut = self.config(base).cut
        return cut if self.keep is None else replace(cut, budget=None, keep=self.keep)


FULL = Setting(Bits(16), None)


def parse_cut_sizes(text: str) -> list[tuple[int | None, float | None]]:
    """"1024,2048,25%" -> [(1024, None), (2048, None), (None, 0.25)]: budgets, or shares of the prompt; "none" ->
    [(None, None)]: no cut compared (a run of the full cache and its noise floor alone)."""
    if text.strip().lower() == "none":
        return [(None, None)]
    sizes = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.endswith("%"):
            try:
                share = float(item[:-1]) / 100
            except ValueError:
                raise ValueError(f"{item!r} is not a share like 25%") from None
            if not 0 < share <= 1:
                raise ValueError(f"a share is above 0% and at most 100%, got {item}")
            sizes.append((None, share))
        else:
            sizes.append((parse_size(item, name="a budget"), None))
    return sizes


def settings_for(tiers: list[Bits | tuple[Bits, float | None]], budget: int, budgets: list[int | tuple] | None = None,
                 methods: list[str] | None = None, floor: str = "", kernels: list[int] | None = None
                 ) -> list[Setting]:
    """The full cache (and, with `floor`, the full cache answered by that engine or dtype: the noise floor), the
    16-bit cache cut per question at each of `budgets` (ints, or (budget, share) pairs) by each of `methods` and
    pooling `kernels` (compression), and each tier (its bits, or its bits and the share it stores: parse_tier) at
    `budget` beside the 16-bit cache at `budget`, cut by the first method (storage)."""
    sizes = [item if isinstance(item, tuple) else (item, None) for item in (budgets or [budget])]
    wanted = [FULL]
    if floor:
        wanted.append(replace(FULL, computation=floor))
    cuts = [cut_method_parts(method) for method in methods or ["snapkv"]]
    for name, flags in cuts:  # a method's name and its flags (cut_method_parts)
        for kernel in kernels or [None]:
            wanted += [Setting(Bits(16), b, k, name, kernel, **flags) for b, k in sizes if (b, k) != (None, None)]
    if tiers:  # cut as the first method cuts
        name, flags = cuts[0]
        for tier in (Bits(16), *tiers):
            bits, stored = tier if isinstance(tier, tuple) else (tier, None)
            wanted.append(Setting(bits, budget, method=name, stored=stored, **flags))
    return list(dict.fromkeys(wanted))


# ------------------------------------------------------------------------------------------ results


@dataclass
class Answer:
    text: str           # the whole answer, up to MAX_ANSWER_TOKENS tokens
    found: bool         # the expected fact is in its first sentence (snapkv.io.facts.fact_found)
    seconds: float


def beyond_chance(count: int, floor: int, questions: int) -> float:
    """One-sided p-value of Fisher's exact test that `count` of `questions` is more than `floor` of as many
    by more than chance: the hypergeometric tail P(X >= count) of the 2x2 table [[count, questions - count],
    [floor, questions - floor]] (small counts: no normal approximation)."""
    if questions <= 0:
        return 1.0
    total = count + floor
    if total == 0:
        return 1.0
    tail = sum(math.comb(questions, x) * math.comb(questions, total - x)
               for x in range(count, min(questions, total) + 1))
    return tail / math.comb(2 * questions, total)


# A setting is beyond the noise floor where it loses facts, or changes answers the reference had right, more often than
# the floor by more than chance: either p-value below this. Changed answers in all (mostly answers that were wrong
# either way, told apart by one token on a near-tie) get their p-value too, reported, not judged.
SIGNIFICANCE = 0.05


@dataclass
class Comparison:
    """One setting's answers against a reference setting's, question by question."""

    setting: str
    reference: str
    questions: int = 0
    agreed: int = 0                  # whole answers identical
    changed: int = 0                 # answers with a number, name or lower-case fact lacking, altered, added or moved
    changed_right: int = 0           # of those, answers whose reference stated the expected fact (not a guess)
    found: int = 0                   # expected facts found by this setting
    reference_found: int = 0
    lost: int = 0                    # found by the reference, not by this setting
    gained: int = 0                  # found by this setting, not by the reference
    kinds: dict = field(default_factory=dict)   # how an answer changed -> count (snapkv.io.facts.how_changed)
    examples: list = field(default_factory=list)  # changed answers: document, question, reference, answer, changes
    file_bytes: int = 0              # summed over the documents (storage comparisons)
    reference_bytes: int = 0
    seconds_per_answer: float = 0.0  # this setting's mean time per answer (its tier's making and loading spread in)
    floor: str = ""                  # the noise floor compared with, where one was measured
    p_changed: float | None = None   # beyond_chance of `changed` against the floor's
    p_changed_right: float | None = None  # of `changed_right`
    p_lost: float | None = None      # of `lost`

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

    @property
    def beyond_floor(self) -> bool | None:
        """Whether it loses facts or changes right answers more than the noise floor by more than chance (None: no
        floor measured)."""
        if self.p_changed_right is None or self.p_lost is None:
            return None
        return min(self.p_changed_right, self.p_lost) < SIGNIFICANCE

    def against_floor(self, floor: "Comparison") -> None:
        """Set floor and the p-values from the noise floor's comparison over the same questions."""
        self.floor = floor.setting
        self.p_changed = beyond_chance(self.changed, floor.changed, self.questions)
        self.p_changed_right = beyond_chance(self.changed_right, floor.changed_right, self.questions)
        self.p_lost = beyond_chance(self.lost, floor.lost, self.questions)

    def to_dict(self) -> dict:
        return {"setting": self.setting, "reference": self.reference, "questions": self.questions,
                "agreed": self.agreed, "agreement": self.agreement, "changed": self.changed,
                "changed_share": self.changed_share, "changed_right": self.changed_right, "found": self.found,
                "reference_found": self.reference_found,
                "lost": self.lost, "gained": self.gained, "kinds": self.kinds, "file_bytes": self.file_bytes,
                "reference_bytes": self.reference_bytes, "bytes_ratio": self.bytes_ratio,
                "seconds_per_answer": self.seconds_per_answer, "floor": self.floor, "p_changed": self.p_changed,
                "p_changed_right": self.p_changed_right, "p_lost": self.p_lost, "beyond_floor": self.beyond_floor, "examples": self.examples}


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
    floor: Comparison | None = None  # the full cache through a second computation against the full cache
    floors: list[Comparison] = field(default_factory=list)  # every such computation measured (floor: the first)
    system: str | None = None        # the system message the documents were prompted with
    cpu: str = ""

    def to_dict(self) -> dict:
        return {"model": self.model, "dtype": self.dtype, "budget": self.budget, "settings": self.settings,
                "system": self.system, "cpu": self.cpu, "answer_tokens": MAX_ANSWER_TOKENS,
                "seconds": self.seconds, "floor": self.floor.to_dict() if self.floor else None,
                "floors": [c.to_dict() for c in self.floors],
                "storage": [c.to_dict() for c in self.storage],
                "compression": [c.to_dict() for c in self.compression], "documents": self.documents}


def compare_settings(documents: list[dict], setting: str, reference: str) -> Comparison:
    """`setting`'s answers against `reference`'s over every question of every document (whole answers)."""
    result = Comparison(setting, reference)
    seconds = 0.0
    for document in documents:
        ours, theirs = document["answers"][setting], document["answers"][reference]
        result.file_bytes += document["file_bytes"].get(setting, 0)
        result.reference_bytes += document["file_bytes"].get(reference, 0)
        seconds += document.get("seconds", {}).get(setting, 0.0)
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
    result.seconds_per_answer = seconds / result.questions if result.questions else 0.0
    return result


def summarize(result: FidelityResult, settings: list[Setting]) -> None:
    """Fill result.storage (each tier against 16 bits at the same budget), result.compression (each 16-bit cut
    against the full cache) and result.floor (the full cache through a second computation against the full cache), and
    judge every comparison against the floor where there is one."""
    names = {s.name for s in settings}
    result.storage = [compare_settings(result.documents, s.name, s.whole_16_bit.name)
                      for s in settings if not s.full and s != s.whole_16_bit and not s.computation
                      and s.whole_16_bit.name in names]
    if FULL.name not in names:  # a run without the full cache (eval fidelity --more): only the tiers compared
        return
    result.compression = [compare_settings(result.documents, s.name, FULL.name)
                          for s in settings if not s.full and s == s.whole_16_bit and not s.computation]
    # every floor measured, the other dtype's first: the variation a user meets between machines (--dtype auto
    # computes in bf16 on some CPUs, fp32 on others); two engines in one dtype agree to the bit where it matters
    floors = sorted((s for s in settings if s.full and s.computation), key=lambda s: s.computation in ENGINE_CHOICES)
    result.floors = [compare_settings(result.documents, s.name, FULL.name) for s in floors]
    result.floor = result.floors[0] if result.floors else None
    if result.floor is not None:
        for comparison in result.storage + result.compression:
            comparison.against_floor(result.floor)


# ------------------------------------------------------------------------------------------ running


def _ask(session: Session, prepared: PreparedDocument, question: Question) -> Answer:
    """The greedy answer, up to MAX_ANSWER_TOKENS tokens or the model's end of turn."""
    started = time.perf_counter()
    stream = session.ask(prepared, question.question, answer_prefix=question.answer_prefix,
                         max_new_tokens=MAX_ANSWER_TOKENS)
    text = question.answer_prefix + "".join(stream)
    return Answer(text.strip(), fact_found(text, question.answer), time.perf_counter() - started)


Progress = Callable[[str], None]


def run_fidelity(loaded: LoadedModel, documents: list[FactDocument], tiers: list, budget: int = DEFAULTS.budget,
                 budgets: list | None = None, base: SnapKVConfig = DEFAULTS,
                 on_progress: Progress | None = None, on_document: Callable[[dict], None] | None = None,
                 settings: list[Setting] | None = None, system: str | None = None,
                 models: dict[str, LoadedModel] | None = None) -> FidelityResult:
    """Every question of every document answered under each setting (default: settings_for(tiers, budget, budgets)).

    Per document the whole prompt is prefilled once into a 16-bit cache; each tier is made from it (no new
    prefill), saved to a file, loaded back, and every question asked of that file.
    system: the system message documents are prompted with (None: the default).
    models: the model loaded in another dtype, by dtype name, for the settings computed in it (the noise floor).
    on_document: called with each document's record once its answers are in (to write partial results).
    """
    from snapkv.engine.models import cpu_description

    settings = settings or settings_for(tiers, budget, budgets or [budget])
    result = FidelityResult(loaded.name, loaded.precision, budget, [s.name for s in settings],
                            system=system, cpu=cpu_description())
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="snapkv-fidelity-") as folder:
        for number, fact_document in enumerate(documents, 1):
            record = {"name": fact_document.name, "questions": [q.__dict__ for q in fact_document.questions],
                      "answers": {}, "file_bytes": {}, "seconds": {}, "tier_seconds": {}}
            whole_session = Session(loaded, FULL.config(base), system=system)
            if on_progress:
                on_progress(f"document {number}/{len(documents)} {fact_document.name}: prefill")
            whole = whole_session.prepare(Document(fact_document.text))
            record["tokens"] = whole.tokens
            by_tier: dict = {}       # the tier's name -> (its file, its bytes)
            tiers_loaded: dict = {}  # (the tier's name, id of the model) -> the file loaded into it
            for setting in settings:
                model = (models or {}).get(setting.computation, loaded)
                engine = setting.computation if setting.computation in ENGINE_CHOICES else None
                session = Session(model, setting.config(base), engine=engine, system=system)
                tier = setting.tier
                if tier not in by_tier:
                    tier_started = time.perf_counter()
                    derived = whole if setting.whole_16_bit.tier == tier else session.derive(whole)
                    path = Path(folder) / f"{number}-{len(by_tier)}.snapkv"
                    session.save(derived, path)
                    by_tier[tier] = (path, derived.file_bytes)
                    record["tier_seconds"][tier] = time.perf_counter() - tier_started
                path, file_bytes = by_tier[tier]
                if (tier, id(model)) not in tiers_loaded:  # the same file, read into each model that answers
                    tiers_loaded[tier, id(model)] = session.load_file(path, check_sources=False)
                loaded_tier = tiers_loaded[tier, id(model)]
                prepared = loaded_tier.answering_with(setting.per_question(base))
                answers = []
                for index, question in enumerate(fact_document.questions):
                    if on_progress:
                        on_progress(f"document {number}/{len(documents)} {fact_document.name}: {setting.name}, "
                                    f"question {index + 1}/{len(fact_document.questions)}")
                    answers.append(_ask(session, prepared, question).__dict__)
                record["answers"][setting.name] = answers
                record["file_bytes"][setting.name] = file_bytes
                record["seconds"][setting.name] = sum(a["seconds"] for a in answers)
            for path, _ in by_tier.values():
                path.unlink()
            result.documents.append(record)
            if on_document:
                on_document(record)
    result.seconds = time.perf_counter() - started
    summarize(result, settings)
    return result
