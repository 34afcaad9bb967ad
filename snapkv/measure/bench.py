"""Full cache vs SnapKV side by side: prefill, first token, decode speed, KV and peak memory, the needle.

Measurements only: dataclasses in, dataclasses out, nothing printed. Every prefill and answer goes
through Session, as the CLI's do, with its measuring option on.
"""

import math
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from snapkv.base.errors import ConfigError, OutOfMemoryError
from snapkv.compression.config import DEFAULTS, SnapKVConfig
from snapkv.engine.memory import check_prefill_fits, release_freed_memory
from snapkv.engine.models import LoadedModel
from snapkv.io.documents import Document
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.measure.floor import floor_ms_per_token, read_bandwidth, weight_bytes_per_token
from snapkv.modeling.architectures import text_config
from snapkv.session import AnswerResult, PreparedDocument, Session

NEEDLE_NUMBER = "48613"
SHARED_NOTE = ("a SnapKV row marked prefill_shared (\"shared\" in the table) made its stored tier from the full cache's "
               "prefill, the same forward pass timed once: its prefill seconds are that pass's and its own tier's")


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
    bytes_per_token: int = 0    # read per decoded token: the weights (snapkv.measure.floor) and the KV decoded against
    floor_ms_per_token: float = 0.0  # bytes_per_token at the read bandwidth measured in the same run
    prefill_chunk: int | None = None  # the SnapKV row was prefilled in chunks of this many tokens
    exact_estimate_seconds: float = 0.0  # the estimate of an exact prefill at this length (snapkv.measure.bench.PrefillRate)
    estimated: bool = False     # not run: the exact prefill would take too long or not fit; prefill_seconds is
                                # its estimate, the other measurements 0
    engine: dict = field(default_factory=dict)  # what answered (snapkv.engine.engines.EngineUse.as_json)
    prefill_shared: bool = False  # the prefill was the full cache's row's (the same forward pass, timed once);
                                  # tier_seconds this row's own (snapkv.measure.bench._prepare)

    @property
    def above_floor(self) -> float:
        """Decode time per token over its memory-bandwidth floor."""
        return self.decode_ms_per_token / self.floor_ms_per_token if self.floor_ms_per_token else 0.0


@dataclass
class FollowUp:
    length: int
    budget: int
    reprefill_seconds: float
    load_seconds: float
    ttft_seconds: float          # the question's pass over the cache, and the first token
    file_bytes: int
    load_split: dict = field(default_factory=dict)  # of load_seconds: read, digest, restore
    round_seconds: list[float] = field(default_factory=list)  # load + first token of every round, in order

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
    read_bandwidth: float = 0.0  # bytes per second, measured in the run (snapkv.measure.floor.read_bandwidth)
    weight_bytes: int = 0        # read per decoded token
    weights: str = ""            # how decoding reads them (LoadedModel.weights)
    growth: dict = field(default_factory=dict)  # method -> {"prefill_seconds": exponent, ...}: fitted n^k
    notes: list[str] = field(default_factory=list)


def _answer(session: Session, prepared: PreparedDocument, max_new_tokens: int, measure: bool = True) -> AnswerResult:
    stream = session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX,
                         max_new_tokens=max_new_tokens, stop_at_end=False, measure=measure)
    for _ in stream:
        pass
    return stream.result


def _row(session: Session, prepared: PreparedDocument, answers: list[AnswerResult], meaningful: bool,
         result: "BenchResult") -> BenchRow:
    settings = session.settings
    read_bytes = result.weight_bytes + answers[0].kv_bytes
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
        bytes_per_token=read_bytes,
        floor_ms_per_token=floor_ms_per_token(result.weight_bytes, answers[0].kv_bytes, result.read_bandwidth),
        prefill_chunk=(settings.prefill_chunk if settings is not None and settings.prefill_chunk
                       and prepared.tokens > settings.prefill_chunk else None),
        engine=answers[-1].engine.as_json(),
    )


def run_bench(loaded: LoadedModel, lengths: list[int], budgets: list[int], *, settings: SnapKVConfig = DEFAULTS,
              decode_tokens: int = 32, repeats: int = 3, allow_extrapolation: bool = False,
              random_weights: bool = False, followup: bool = True, filler: str | None = None,
              on_row=None, on_progress: Callable[[str], None] | None = None, max_prefill_seconds: float = 600.0,
              prefill_chunk: int = 4096, engine: str | None = None) -> BenchResult:
    """For each length: the full cache and SnapKV (`settings` at each budget), in this one process.

    Each method is prefilled once (a stored tier made after the prefill, as the query-aware default's, from the full
    cache's own forward pass: _prepare); then the answers (first token and decode) are timed `repeats` times,
    taking the methods in turn each round, and the medians reported, so that a slow spell on a shared
    machine does not land on one method only. A short warm-up prefill comes first, and times the machine's
    prefill rate: a length whose exact prefill is estimated past `max_prefill_seconds`, or does not fit in
    memory, gets SnapKV prefilled in chunks of `prefill_chunk` tokens and the full cache's estimate instead.
    on_row(row) as each row is measured; on_progress(text) as each prefill starts and at each tenth of it (a 128k
    prefill takes minutes).
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
    result = BenchResult(loaded.name, str(loaded.device), loaded.precision,
                         read_bandwidth=read_bandwidth(loaded.device), weight_bytes=weight_bytes_per_token(loaded.model),
                         weights=loaded.weights)
    if random_weights:
        result.notes.append("random weights: the answers, and so needle_found, are meaningless")
    if too_long:
        result.notes.append(f"lengths past the model's {context} tokens: needle_found is not meaningful there")
    chunked = replace(settings, prefill_chunk=prefill_chunk)
    sessions = [Session(loaded, None, allow_extrapolation=True, engine=engine)] + [
        Session(loaded, replace(settings, budget=budget), allow_extrapolation=True, engine=engine)
        for budget in budgets]
    chunked_sessions = [Session(loaded, replace(chunked, budget=budget), allow_extrapolation=True, engine=engine)
                        for budget in budgets]
    warm_up = Document(build_haystack(loaded.tokenizer, filler, 256, 0.5, NEEDLE_NUMBER).text)
    sessions[0].prepare(sessions[0].prompt(warm_up, max_tokens=min(256, min(lengths))))
    calibration = Document(build_haystack(loaded.tokenizer, filler, 1024, 0.5, NEEDLE_NUMBER).text)
    rate = PrefillRate.measure(loaded, sessions[0], sessions[0].prompt(calibration, max_tokens=min(1024, min(lengths))))
    for length in lengths:
        document = Document(build_haystack(loaded.tokenizer, filler, length, 0.5, NEEDLE_NUMBER).text)
        meaningful = not random_weights and not (context and length > context)
        exact_fits = rate.exact_seconds(length) <= max_prefill_seconds and _fits(loaded, length)
        active = sessions if exact_fits else [None] + chunked_sessions
        if not exact_fits:
            result.notes.append(
                f"{length} tokens: the exact prefill would take about {rate.exact_seconds(length):.0f} s "
                f"(over --max-prefill-seconds {max_prefill_seconds:g}) or not fit in memory; SnapKV is "
                f"prefilled in chunks of {prefill_chunk} tokens and the full cache's row is that estimate")
        prepared: list[PreparedDocument | None] = []
        shared: list[bool] = []  # per method: its prefill was the full cache's row's
        for session in active:
            made, from_full = _prepare(session, document, length, prepared[0] if prepared else None, on_progress)
            prepared.append(made)
            shared.append(from_full)
        answers: list[list[AnswerResult]] = [[] for _ in active]
        for _ in range(repeats):
            for index, session in enumerate(active):
                if session is not None:
                    answers[index].append(_answer(session, prepared[index], decode_tokens))
        for session, prepared_one, answered, from_full in zip(active, prepared, answers, shared):
            row = (_row(session, prepared_one, answered, meaningful, result) if session is not None
                   else BenchRow(length, "full", None, False, rate.exact_seconds(length), 0.0, 0.0, 0, 0, None,
                                 estimated=True))
            row.prefill_shared = from_full
            if from_full and SHARED_NOTE not in result.notes:
                result.notes.append(SHARED_NOTE)
            row.exact_estimate_seconds = rate.exact_seconds(length)
            result.rows.append(row)
            if on_row:
                on_row(row)
        if followup and budgets and length == lengths[-1] and exact_fits:
            kept, reprefill_seconds = prepared[1], prepared[0].prefill_seconds
            del made, prepared_one  # the loops' last: no reference left to a cache but the one followed up
            prepared.clear()  # the other methods' caches freed before the follow-up loads (an 8B shape's full: 0.5 GB)
            result.followup = _followup(sessions[1], kept, reprefill_seconds)
    result.growth = fit_growth(result.rows)
    return result


def _prepare(session: Session | None, document: Document, length: int, whole: PreparedDocument | None,
             on_progress: Callable[[str], None] | None) -> tuple[PreparedDocument | None, bool]:
    """A method's cache of `document` at `length` tokens, and whether its prefill was the full cache's row's.

    A stored tier chosen after the prefill (the query-aware default: the whole prompt in fewer bits, or a share of it
    chosen by probes) starts from the very forward pass the full cache's row (`whole`) ran: that prefill is timed once,
    its seconds (with its rounding to 16 bits) and peak counted in this row as well, and the tier is made from its
    16-bit cache as snapkv.engine.tiers.build_tier makes it from its own prefill's (Session.derive), timed and added.
    Anything else (a cut during the prefill, in chunks or not) is prefilled."""
    if session is None:
        return None, False
    prompt = session.prompt(document, max_tokens=length)
    if (whole is not None and session.settings is not None and session.plan.during_prefill is None
            and torch.equal(whole.cache.token_ids, prompt.ids)):
        if on_progress is not None:
            on_progress(f"{_label(session)}: its tier from the full cache's prefill of {length} tokens (the same "
                        "forward pass)...")
        derived = session.derive(whole, measure=True)
        # its own prefill rounds the pass's cache to 16 bits too (the full row's tier), then makes its tier from that;
        # it would hold the pass's peak, then its whole cache while the tier is made
        peak = max(whole.prefill_peak_bytes, whole.cache.kv_bytes + derived.prefill_peak_bytes)
        return replace(derived, document=prompt.document, prefill_seconds=whole.prefill_seconds + derived.tier_seconds,
                       tier_seconds=whole.tier_seconds + derived.tier_seconds, prefill_peak_bytes=peak), True
    return session.prepare(prompt, measure=True,
                           on_layer=_tenths(on_progress, f"Prefilling {length} tokens, {_label(session)}")), False


def _label(session: Session) -> str:
    """The method a session measures, as a progress line names it."""
    settings = session.settings
    if settings is None:
        return "full cache"
    chunks = f" in chunks of {settings.prefill_chunk}" if settings.prefill_chunk else ""
    return f"SnapKV at {settings.budget}{chunks}"


def _tenths(on_progress: Callable[[str], None] | None, label: str) -> Callable[[int, int], None] | None:
    """A prefill's progress callback (parts done, in all) that says `label` and the share done at each tenth."""
    if on_progress is None:
        return None
    on_progress(f"{label}...")
    said = [0]

    def on_part(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth > said[0]:
            said[0] = tenth
            on_progress(f"{label}: {tenth * 10}% done...")
    return on_part


def _fits(loaded: LoadedModel, length: int) -> bool:
    try:
        check_prefill_fits(loaded.model, length, loaded.device, loaded.dtype, None)
    except OutOfMemoryError:
        return False
    return True


@dataclass(frozen=True)
class PrefillRate:
    """What an exact prefill of n tokens would take: its floating-point work (2 x parameters per token, and
    attention's 2 x layers x hidden per pair of positions, causal) at the rate a short prefill ran."""

    flops_per_second: float
    parameters: int
    layers: int
    hidden: int

    def flops(self, tokens: int) -> float:
        return 2 * self.parameters * tokens + 2 * self.layers * self.hidden * tokens * tokens

    def exact_seconds(self, tokens: int) -> float:
        return self.flops(tokens) / self.flops_per_second

    @classmethod
    def measure(cls, loaded: LoadedModel, session: Session, prompt) -> "PrefillRate":
        """Timed on `prompt` (a short exact prefill): its prefill seconds alone, not the memory hand-back."""
        from snapkv.modeling.gguf_weights import GGUFLinear

        config = text_config(loaded.model)
        embeddings = {loaded.model.get_input_embeddings().weight.data_ptr()}
        head = loaded.model.get_output_embeddings()
        if head is not None and not isinstance(head, GGUFLinear):
            embeddings.add(head.weight.data_ptr())
        # the embedding table is looked up, and the head runs on the last position only; a GGUF file's projections
        # are blocks, not parameters: counted by their shapes
        parameters = sum(p.numel() for p in loaded.model.parameters() if p.data_ptr() not in embeddings)
        parameters += sum(module.in_features * module.out_features for module in loaded.model.modules()
                          if isinstance(module, GGUFLinear) and module is not head)
        seconds = max(session.prepare(prompt, measure=True).prefill_seconds, 1e-6)
        rate = cls(1.0, parameters, config.num_hidden_layers, config.hidden_size)
        return replace(rate, flops_per_second=rate.flops(prompt.tokens) / seconds)


def series_name(row: BenchRow) -> str:
    """"full", "snapkv 1024" or "snapkv 1024 in chunks of 4096": rows of one method measured across lengths."""
    name = row.method if row.budget is None else f"{row.method} {row.budget}"
    return name + (f" in chunks of {row.prefill_chunk}" if row.prefill_chunk else "")


def fit_growth(rows: list[BenchRow]) -> dict:
    """Per method (and budget), the exponent k of a least-squares fit of value = c x length^k in log-log, for
    prefill time, decode time and peak memory, over the rows measured (estimates left out)."""
    growth = {}
    series = {}
    for row in rows:
        if not row.estimated:
            series.setdefault(series_name(row), []).append(row)
    for name, measured in series.items():
        if len({row.length for row in measured}) < 2:
            continue
        fitted = {}
        for key in ("prefill_seconds", "decode_ms_per_token", "peak_memory_bytes"):
            points = [(math.log(row.length), math.log(getattr(row, key))) for row in measured if getattr(row, key) > 0]
            if len(points) >= 2:
                mean_x = sum(x for x, _ in points) / len(points)
                mean_y = sum(y for _, y in points) / len(points)
                spread = sum((x - mean_x) ** 2 for x, _ in points)
                fitted[key] = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
        growth[name] = fitted
    return growth


FOLLOWUP_ROUNDS = 3  # a follow-up takes ~0.3 s, where a busy moment of a shared machine weighs: the median round


def _followup(session: Session, prepared: PreparedDocument, reprefill_seconds: float) -> FollowUp:
    """A second question from the saved cache, vs prefilling again: saved once, then FOLLOWUP_ROUNDS rounds of load +
    first token, the round of median total reported. Asked as `snapkv serve` asks it, in a process that goes on;
    what a round freed is handed back to the OS before the next (untimed: an 8B shape's rounds otherwise held 1.4 GB
    more at the end than the rows' peak)."""
    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bench.snapkv"
        session.save(prepared, path)
        for _ in range(FOLLOWUP_ROUNDS):  # each round's figures kept, not its cache (freed before the next load)
            release_freed_memory()  # untimed: what the last round freed goes back, so rounds do not pile up
            reloaded = session.load_file(path, check_sources=False)
            first = _answer(session, reloaded, max_new_tokens=1, measure=False)
            rounds.append((reloaded.load_seconds + first.ttft_seconds, reloaded.load_seconds, first.ttft_seconds,
                           reloaded.load_split))
            del reloaded, first
    _, load_seconds, ttft_seconds, load_split = sorted(rounds, key=lambda found: found[0])[len(rounds) // 2]
    return FollowUp(prepared.tokens, session.settings.budget, reprefill_seconds, load_seconds, ttft_seconds,
                    prepared.file_bytes, load_split, [total for total, *_ in rounds])
