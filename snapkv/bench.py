"""Full cache vs SnapKV side by side: prefill, first token, decode speed, KV and peak memory, the needle.

Measurements only: dataclasses in, dataclasses out, nothing printed.
"""

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import SnapKVConfig
from .errors import ConfigError
from .generation import answer, prefill
from .haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack
from .memory import PeakMemory, check_prefill_fits
from .models import LoadedModel
from .prompting import context_ids, document_ids, question_ids
from .store import load_cache, save_cache

NEEDLE_NUMBER = "48613"


def parse_length(text: str) -> int:
    """'8k' -> 8192, '128k' -> 131072, '1m' -> 1048576, '7000' -> 7000."""
    text = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError as error:
        raise ConfigError(f"not a length: {text!r} (use e.g. 7000, 8k, 128k)") from error
    if value < 16:
        raise ConfigError(f"length {value} is too short to measure")
    return value


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def haystack_prompt(loaded: LoadedModel, filler: str, length: int) -> tuple[torch.Tensor, str]:
    """(length,) context ids with the needle in the middle of the filler, cut to exactly `length` tokens."""
    tokenizer = loaded.tokenizer
    overhead = context_ids(tokenizer, [0]).shape[0] - 1
    haystack = build_haystack(tokenizer, filler, length, 0.5, NEEDLE_NUMBER)
    body = document_ids(tokenizer, haystack.text)[: max(length - overhead, 1)]
    return context_ids(tokenizer, body), haystack.number


@dataclass
class _Method:
    """One column of the comparison at one length: its settings, its cache, and its timings so far."""

    settings: SnapKVConfig | None
    cache: object = None
    prefill_seconds: float = 0.0
    prefill_peak: int = 0
    ttfts: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)
    answer_peak: int = 0
    text: str = ""


def _prefill_phase(loaded: LoadedModel, ids: torch.Tensor, method: _Method) -> None:
    settings = method.settings
    tier = settings.stored_tier if settings is not None else None
    check_prefill_fits(loaded.model, ids.shape[0], loaded.device, loaded.dtype, tier)
    with PeakMemory(loaded.device, release=True) as memory:
        _sync(loaded.device)
        started = time.perf_counter()
        method.cache = prefill(loaded.model, ids, tier)
        _sync(loaded.device)
        method.prefill_seconds = time.perf_counter() - started
    method.prefill_peak = memory.peak


def _answer_phase(loaded: LoadedModel, method: _Method, question: torch.Tensor, decode_tokens: int) -> None:
    settings = method.settings
    per_question = settings if settings is not None and settings.query_aware else None
    device = loaded.device
    with PeakMemory(device, release=True) as memory:
        started = time.perf_counter()
        stream = answer(loaded.model, method.cache, question, per_question=per_question, max_new_tokens=decode_tokens)
        tokens = [next(stream)]
        _sync(device)
        first = time.perf_counter()
        tokens += list(stream)
        _sync(device)
        ended = time.perf_counter()
    method.ttfts.append(first - started)
    method.decode_ms.append(1000 * (ended - first) / max(len(tokens) - 1, 1))
    method.answer_peak = max(method.answer_peak, memory.peak)
    method.text = loaded.tokenizer.decode(tokens)


def _row(length: int, method: _Method, question: torch.Tensor, number: str, meaningful: bool) -> BenchRow:
    settings, cache = method.settings, method.cache
    kv_bytes = cache.kv_bytes
    if settings is not None and settings.query_aware:  # decoded against the per-question cut, not the tier
        kept = min(cache.kept_tokens, settings.budget - settings.window + question.shape[0])
        kv_bytes = cache.kv_bytes * kept // max(cache.kept_tokens, 1)
    return BenchRow(
        length=length, method="full" if settings is None else "snapkv",
        budget=None if settings is None else settings.budget,
        query_aware=bool(settings and settings.query_aware),
        prefill_seconds=method.prefill_seconds, ttft_seconds=statistics.median(method.ttfts),
        decode_ms_per_token=statistics.median(method.decode_ms),
        kv_bytes=kv_bytes, peak_memory_bytes=method.prefill_peak, answer_peak_memory_bytes=method.answer_peak,
        needle_found=(number in method.text) if meaningful else None,
    )


def run_bench(loaded: LoadedModel, filler: str, lengths: list[int], budgets: list[int], *, window: int = 32,
              kernel: int = 15, pooling: str = "max", query_aware: bool = True, decode_tokens: int = 32,
              repeats: int = 3, allow_extrapolation: bool = False, random_weights: bool = False,
              followup: bool = True, on_row=None) -> BenchResult:
    """For each length: the full cache and SnapKV at each budget, in this one process.

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
    result = BenchResult(loaded.name, str(loaded.device), str(loaded.dtype).replace("torch.", ""))
    if random_weights:
        result.notes.append("random weights: the answers, and so needle_found, are meaningless")
    if too_long:
        result.notes.append(f"lengths past the model's {context} tokens: needle_found is not meaningful there")
    question = question_ids(loaded.tokenizer, NEEDLE_QUESTION, NEEDLE_ANSWER_PREFIX)
    prefill(loaded.model, haystack_prompt(loaded, filler, min(256, min(lengths)))[0], None)  # warm-up
    for length in lengths:
        ids, number = haystack_prompt(loaded, filler, length)
        meaningful = not random_weights and not (context and length > context)
        methods = [_Method(None)] + [
            _Method(SnapKVConfig(budget=budget, window=window, kernel=kernel, pooling=pooling,
                                 query_aware=query_aware)) for budget in budgets]
        for method in methods:
            _prefill_phase(loaded, ids, method)
        for _ in range(repeats):
            for method in methods:
                _answer_phase(loaded, method, question, decode_tokens)
        for method in methods:
            row = _row(ids.shape[0], method, question, number, meaningful)
            result.rows.append(row)
            if on_row:
                on_row(row)
        if followup and length == lengths[-1]:
            full, first = methods[0], methods[1]
            result.followup = _followup(loaded, first.cache, first.settings, full.prefill_seconds)
    return result


def _followup(loaded: LoadedModel, cache, settings: SnapKVConfig, reprefill_seconds: float) -> FollowUp:
    """A second question from the saved cache: save, then load + first token, vs prefilling again."""
    question = question_ids(loaded.tokenizer, NEEDLE_QUESTION, NEEDLE_ANSWER_PREFIX)
    per_question = settings if settings.query_aware else None
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bench.snapkv"
        file_bytes = save_cache(path, cache, {"bench": True})
        started = time.perf_counter()
        loaded_cache, _ = load_cache(path, device=loaded.layer_devices, dtype=loaded.dtype)
        load_seconds = time.perf_counter() - started
        started = time.perf_counter()
        next(answer(loaded.model, loaded_cache, question, per_question=per_question, max_new_tokens=1))
        _sync(loaded.device)
        ttft = time.perf_counter() - started
    return FollowUp(cache.original_length, settings.budget, reprefill_seconds, load_seconds, ttft, file_bytes)
