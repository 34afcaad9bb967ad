"""Accuracy of SnapKV against the full cache: the needle grid, and many questions on one saved cache.

Measurements only: dataclasses out, nothing printed.
"""

import random
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from snapkv.compression.config import DEFAULTS, Plan, SnapKVConfig
from snapkv.engine.models import LoadedModel
from snapkv.io.documents import Document
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.session import PreparedDocument, Session


@dataclass(frozen=True)
class EvalSetting:
    """One way of answering: the full cache, or SnapKV in one mode at one budget."""

    name: str
    config: SnapKVConfig | None

    @classmethod
    def grid(cls, budgets: list[int], base: SnapKVConfig = DEFAULTS,
             modes: tuple[str, ...] = ("query-aware", "document-window")) -> list["EvalSetting"]:
        """The full cache, then `base` in each mode at each budget."""
        settings = [cls("full", None)]
        for mode in modes:
            for budget in budgets:
                config = replace(base, budget=budget, query_aware=mode == "query-aware")
                settings.append(cls.named(config))
        return settings

    @classmethod
    def named(cls, config: SnapKVConfig) -> "EvalSetting":
        """A setting named by its mode and budget, and by its stored tier where that is not the default one:
        "query-aware 1024", "query-aware 1024, whole 16-bit", "query-aware 1024, reconstruction 50% 4-bit"."""
        name = f"{config.mode} {config.budget}"
        store_fields = ("store_keep", "store_budget", "store_method", "store_bits", "store_kernel")
        if all(getattr(config, f) == getattr(DEFAULTS, f) for f in store_fields):
            return cls(name, config)
        stored = config.stored_tier if config.query_aware else None
        if stored is not None:
            size = f"{stored.keep:.0%}" if stored.keep is not None else str(stored.budget)
            name += f", {stored.method.name} {size} {config.store_bits}-bit"
        else:
            name += f", {'whole ' if config.query_aware else ''}{config.store_bits}-bit"
        return cls(name, config)


@dataclass
class NeedleResult:
    lengths: list[int]
    depths: list[float]
    # setting name -> [length index][depth index] found?
    found: dict[str, list[list[bool]]] = field(default_factory=dict)
    answers: dict[str, list[list[str]]] = field(default_factory=dict)

    def accuracy(self, name: str) -> float:
        cells = [cell for row in self.found[name] for cell in row]
        return sum(cells) / len(cells) if cells else 0.0


def _needle_number(length_index: int, depth_index: int) -> str:
    return str(random.Random(length_index * 1000 + depth_index).randrange(10000, 99999))


WHOLE = (None, 16)  # the whole prompt in 16 bits: the full cache, and what tiers chosen after a prefill start from


def _prepare(session: Session, document: Document, by_tier: dict) -> PreparedDocument:
    """Once per stored tier and bits. The full cache serves 'full' and every query-aware budget of a whole tier;
    a tier chosen after the prefill is derived from it (scored once per method: by_tier["scores"])."""
    settings = session.settings
    plan = Plan.of(settings)
    key = (plan.stored, plan.bits)
    if key not in by_tier:
        stored, whole = key[0], by_tier.get(WHOLE)
        if whole is not None and (stored is None or not stored.method.scores_during_prefill):
            by_tier[key] = session.derive(whole, scores_memo=by_tier.setdefault("scores", {}))
        else:
            by_tier[key] = session.prepare(document)
    return by_tier[key].answering_with(plan.per_question)


def needle_grid(loaded: LoadedModel, lengths: list[int], depths: list[float], settings: list[EvalSetting],
                on_cell=None, filler: str | None = None) -> NeedleResult:
    """The paper's needle-in-a-haystack grid for each setting."""
    filler = filler or filler_text()
    result = NeedleResult(lengths, depths)
    for setting in settings:
        result.found[setting.name] = [[False] * len(depths) for _ in lengths]
        result.answers[setting.name] = [[""] * len(depths) for _ in lengths]
    for li, length in enumerate(lengths):
        for di, depth in enumerate(depths):
            haystack = build_haystack(loaded.tokenizer, filler, length, depth, _needle_number(li, di))
            document = Document(haystack.text)
            prepared_by_tier: dict = {}
            for setting in settings:
                session = Session(loaded, setting.config)
                prepared = _prepare(session, document, prepared_by_tier)
                text = "".join(session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX,
                                           max_new_tokens=10))
                result.found[setting.name][li][di] = haystack.number in text
                result.answers[setting.name][li][di] = text.strip()
                if on_cell:
                    on_cell(setting.name, length, depth)
    return result


# ------------------------------------------------------------------------------------------ many questions

# (statement, question, answer start): each fact worded differently, so a small model can tell them apart
_FACT_TEMPLATES = [
    ("The lighthouse keeper's door code is {number}.", "What is the lighthouse keeper's door code?",
     "The lighthouse keeper's door code is"),
    ("Last winter the river ferry carried {number} passengers.", "How many passengers did the river ferry carry last winter?",
     "Last winter the river ferry carried"),
    ("The village bakery sold {number} loaves at the spring fair.", "How many loaves did the village bakery sell at the spring fair?",
     "The village bakery sold"),
    ("The map archive keeps its oldest chart in drawer {number}.", "In which drawer does the map archive keep its oldest chart?",
     "The map archive keeps its oldest chart in drawer"),
    ("The clock tower's bell weighs {number} kilograms.", "How much does the clock tower's bell weigh?",
     "The clock tower's bell weighs"),
    ("The walled garden has {number} rose bushes.", "How many rose bushes does the walled garden have?",
     "The walled garden has"),
    ("The old library's membership number for the mayor is {number}.", "What is the mayor's membership number at the old library?",
     "The mayor's membership number at the old library is"),
    ("The harbour crane lifted {number} containers in March.", "How many containers did the harbour crane lift in March?",
     "The harbour crane lifted"),
    ("The mountain hut stands at {number} metres above the sea.", "At what height does the mountain hut stand?",
     "The mountain hut stands at"),
    ("The night train's locomotive has serial number {number}.", "What is the serial number of the night train's locomotive?",
     "The night train's locomotive has serial number"),
]


@dataclass(frozen=True)
class Fact:
    template: int
    number: str

    @property
    def sentence(self) -> str:
        return _FACT_TEMPLATES[self.template][0].format(number=self.number)

    @property
    def question(self) -> str:
        return _FACT_TEMPLATES[self.template][1]

    @property
    def answer_prefix(self) -> str:
        return _FACT_TEMPLATES[self.template][2]


@dataclass
class MultiResult:
    tokens: int
    facts: list[Fact]
    # setting name -> found per fact, asked in turn against one loaded cache
    found: dict[str, list[bool]] = field(default_factory=dict)
    file_bytes: dict[str, int] = field(default_factory=dict)

    def accuracy(self, name: str) -> float:
        return sum(self.found[name]) / len(self.found[name]) if self.found[name] else 0.0


def multi_fact_document(tokenizer, filler: str, tokens: int, count: int, seed: int = 0) -> tuple[str, list[Fact]]:
    """Filler of about `tokens` tokens with `count` different facts spread through it."""
    generator = random.Random(seed)
    facts = [Fact(index, str(generator.randrange(10000, 99999))) for index in range(min(count, len(_FACT_TEMPLATES)))]
    base = build_haystack(tokenizer, filler, tokens, 0.0, "0").text.split("\n\n")[1:]  # drop the placeholder
    for index, fact in enumerate(facts):
        position = round((index + 0.5) / len(facts) * len(base)) + index
        base.insert(position, fact.sentence)
    return "\n\n".join(base), facts


def many_questions(loaded: LoadedModel, tokens: int, count: int, settings: list[EvalSetting],
                   on_answer=None, filler: str | None = None) -> MultiResult:
    """One document, compressed once and saved; every question asked against the one cache loaded back."""
    text, facts = multi_fact_document(loaded.tokenizer, filler or filler_text(), tokens, count)
    document = Document(text)
    result = MultiResult(tokens=0, facts=facts)
    prepared_by_tier: dict = {}
    with tempfile.TemporaryDirectory() as folder:
        for index, setting in enumerate(settings):
            session = Session(loaded, setting.config)
            path = Path(folder) / f"{index}.snapkv"
            session.save(_prepare(session, document, prepared_by_tier), path)
            reloaded = session.load_file(path)  # loaded back from the file, as a later process would
            result.tokens = reloaded.tokens
            result.file_bytes[setting.name] = reloaded.file_bytes
            found = []
            for fact in facts:
                answer_text = "".join(session.ask(reloaded, fact.question, answer_prefix=fact.answer_prefix,
                                                  max_new_tokens=10))
                found.append(fact.number in answer_text)
                if on_answer:
                    on_answer(setting.name, fact)
            result.found[setting.name] = found
    return result
