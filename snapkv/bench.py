"""Full cache vs SnapKV side by side: prefill, first token, decode speed, KV and peak memory, the needle.

Measurements only: dataclasses in, dataclasses out, nothing printed. Every prefill and answer goes
through Session, as the CLI's do, with its measuring option on.
"""

import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from .config import DEFAULTS, SnapKVConfig
from .documents import Document
from .errors import ConfigError
from .haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from .models import LoadedModel
from .session import AnswerResult, PreparedDocument, Session

NEEDLE_NUMBER = "48613"


@dataclass
class BenchRow:
    length: int
    method: str                 # "full" or "snapkv"
    budget: int | None
    query_aware: bool
    prefill_seconds: float
    ttft_seconds: float
    decode_ms_per_token: float
    kv_bytes: int               # what is decoded against
    peak_memory_bytes: int      # the prefill's: RSS growth on CPU, CUDA max allocated (weights included) on GPU
    needle_found: bool | None   # None when the answer is not meaningful (random weights, extrapolation)
    answer_peak_memory_bytes: int = 0  # the same for the question pass and decoding
    stored_bytes: int = 0       # the stored tier's keys and values as a file holds them
    tier_seconds: float = 0.0   # of prefill_seconds, choosing the stored tier after the prefill


@dataclass
class FollowUp:
    length: int
    budget: int
    reprefill_seconds: float
    load_seconds: float
    ttft_seconds: float
    file_bytes: int

    @property
    def speedup(self) -> float:
        return self.reprefill_seconds / (self.load_seconds + self.ttft_seconds)


@dataclass
class BenchResult:
    model: str
    device: str
    dtype: str
    rows: list[BenchRow] = field(default_factory=list)
    followup: FollowUp | None = None
    notes: list[str] = field(default_factory=list)


def _answer(session: Session, prepared: PreparedDocument, max_new_tokens: int) -> AnswerResult:
    stream = session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX,
                         max_new_tokens=max_new_tokens, stop_at_end=False, measure=True)
    for _ in stream:
        pass
    return stream.result


def _row(session: Session, prepared: PreparedDocument, answers: list[AnswerResult], meaningful: bool) -> BenchRow:
    settings = session.settings
    return BenchRow(
        length=prepared.tokens, method="full" if settings is None else "snapkv",
        budget=None if settings is None else settings.budget,
        query_aware=prepared.per_question is not None,
        prefill_seconds=prepared.prefill_seconds,
        ttft_seconds=statistics.median(a.ttft_seconds for a in answers),
        decode_ms_per_token=statistics.median(a.decode_ms_per_token for a in answers),
        kv_bytes=answers[0].kv_bytes, peak_memory_bytes=prepared.prefill_peak_bytes,
        answer_peak_memory_bytes=max(a.peak_bytes for a in answers),
        needle_found=(NEEDLE_NUMBER in answers[-1].text) if meaningful else None,
        stored_bytes=prepared.cache.stored_kv_bytes, tier_seconds=prepared.tier_seconds,
    )


def run_bench(loaded: LoadedModel, lengths: list[int], budgets: list[int], *, settings: SnapKVConfig = DEFAULTS,
              decode_tokens: int = 32, repeats: int = 3, allow_extrapolation: bool = False,
              random_weights: bool = False, followup: bool = True, filler: str | None = None,
              on_row=None) -> BenchResult:
    """For each length: the full cache and SnapKV (`settings` at each budget), in this one process.

    Each method is prefilled once; then the answers (first token and decode) are timed `repeats` times,
    taking the methods in turn each round, and the medians reported, so that a slow spell on a shared
    machine does not land on one method only. A short warm-up prefill comes first.
    """
    context = loaded.context_length
    too_long = [n for n in lengths if context and n > context]
    if too_long and not allow_extrapolation:
        raise ConfigError(
            f"{loaded.name} holds {context} tokens; {', '.join(map(str, too_long))} would go past it. "
            "Pass --allow-extrapolation to measure speed and memory anyway (answers are then not meaningful), "
            "or use a model with a longer context."
        )
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, not {repeats}")
    filler = filler or filler_text()
    result = BenchResult(loaded.name, str(loaded.device), str(loaded.dtype).replace("torch.", ""))
    if random_weights:
        result.notes.append("random weights: the answers, and so needle_found, are meaningless")
    if too_long:
        result.notes.append(f"lengths past the model's {context} tokens: needle_found is not meaningful there")
    sessions = [Session(loaded, None, allow_extrapolation=True)] + [
        Session(loaded, replace(settings, budget=budget), allow_extrapolation=True) for budget in budgets]
    warm_up = Document(build_haystack(loaded.tokenizer, filler, 256, 0.5, NEEDLE_NUMBER).text)
    sessions[0].prepare(sessions[0].prompt(warm_up, max_tokens=min(256, min(lengths))))
    for length in lengths:
        document = Document(build_haystack(loaded.tokenizer, filler, length, 0.5, NEEDLE_NUMBER).text)
        meaningful = not random_weights and not (context and length > context)
        prepared = [session.prepare(session.prompt(document, max_tokens=length), measure=True)
                    for session in sessions]
        answers: list[list[AnswerResult]] = [[] for _ in sessions]
        for _ in range(repeats):
            for index, session in enumerate(sessions):
                answers[index].append(_answer(session, prepared[index], decode_tokens))
        for session, prepared_one, answered in zip(sessions, prepared, answers):
            row = _row(session, prepared_one, answered, meaningful)
            result.rows.append(row)
            if on_row:
                on_row(row)
        if followup and budgets and length == lengths[-1]:
            result.followup = _followup(sessions[1], prepared[1], prepared[0].prefill_seconds)
    return result


def _followup(session: Session, prepared: PreparedDocument, reprefill_seconds: float) -> FollowUp:
    """A second question from the saved cache: save, then load + first token, vs prefilling again."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bench.snapkv"
        session.save(prepared, path)
        reloaded = session.load_file(path, check_sources=False)
        first = _answer(session, reloaded, max_new_tokens=1)
    return FollowUp(prepared.tokens, session.settings.budget, reprefill_seconds, reloaded.load_seconds,
                    first.ttft_seconds, prepared.file_bytes)
