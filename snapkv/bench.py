"""Full cache vs SnapKV side by side: prefill, first token, decode speed, KV and peak memory, the needle.

Measurements only: dataclasses in, dataclasses out, nothing printed.
"""

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


def _measure(loaded: LoadedModel, ids: torch.Tensor, number: str, settings: SnapKVConfig | None,
             decode_tokens: int, meaningful: bool):
    model, device = loaded.model, loaded.device
    question = question_ids(loaded.tokenizer, NEEDLE_QUESTION, NEEDLE_ANSWER_PREFIX)
    tier = settings.stored_tier if settings is not None else None
    per_question = settings if settings is not None and settings.query_aware else None
    check_prefill_fits(model, ids.shape[0], device, loaded.dtype, tier)
    with PeakMemory(device) as memory:
        _sync(device)
        started = time.perf_counter()
        cache = prefill(model, ids, tier)
        _sync(device)
        prefill_seconds = time.perf_counter() - started
    with PeakMemory(device) as answer_memory:
        started = time.perf_counter()
        stream = answer(model, cache, question, per_question=per_question, max_new_tokens=decode_tokens)
        tokens = [next(stream)]
        _sync(device)
        first = time.perf_counter()
        tokens += list(stream)
        _sync(device)
        ended = time.perf_counter()
    text = loaded.tokenizer.decode(tokens)
    kv_bytes = cache.kv_bytes
    if per_question is not None:  # decoded against the per-question cut, not the stored tier
        kept = min(cache.kept_tokens, settings.budget - settings.window + question.shape[0])
        kv_bytes = cache.kv_bytes * kept // max(cache.kept_tokens, 1)
    row = BenchRow(
        length=ids.shape[0], method="full" if settings is None else "snapkv",
        budget=None if settings is None else settings.budget,
        query_aware=bool(settings and settings.query_aware),
        prefill_seconds=prefill_seconds, ttft_seconds=first - started,
        decode_ms_per_token=1000 * (ended - first) / max(len(tokens) - 1, 1),
        kv_bytes=kv_bytes, peak_memory_bytes=memory.peak, answer_peak_memory_bytes=answer_memory.peak,
        needle_found=(number in text) if meaningful else None,
    )
    return row, cache


def run_bench(loaded: LoadedModel, filler: str, lengths: list[int], budgets: list[int], *, window: int = 32,
              kernel: int = 15, pooling: str = "max", query_aware: bool = True, decode_tokens: int = 32,
              allow_extrapolation: bool = False, random_weights: bool = False, followup: bool = True,
              on_row=None) -> BenchResult:
    """For each length: the full cache, then SnapKV at each budget, in this one process."""
    context = loaded.context_length
    too_long = [n for n in lengths if context and n > context]
    if too_long and not allow_extrapolation:
        raise ConfigError(
            f"{loaded.name} holds {context} tokens; {', '.join(map(str, too_long))} would go past it. "
            "Pass --allow-extrapolation to measure speed and memory anyway (answers are then not meaningful), "
            "or use a model with a longer context."
        )
    result = BenchResult(loaded.name, str(loaded.device), str(loaded.dtype).replace("torch.", ""))
    if random_weights:
        result.notes.append("random weights: the answers, and so needle_found, are meaningless")
    if too_long:
        result.notes.append(f"lengths past the model's {context} tokens: needle_found is not meaningful there")
    for length in lengths:
        ids, number = haystack_prompt(loaded, filler, length)
        meaningful = not random_weights and not (context and length > context)
        full_row, _ = _measure(loaded, ids, number, None, decode_tokens, meaningful)
        result.rows.append(full_row)
        if on_row:
            on_row(full_row)
        for budget in budgets:
            settings = SnapKVConfig(budget=budget, window=window, kernel=kernel, pooling=pooling,
                                    query_aware=query_aware)
            row, cache = _measure(loaded, ids, number, settings, decode_tokens, meaningful)
            result.rows.append(row)
            if on_row:
                on_row(row)
            if followup and length == lengths[-1] and budget == budgets[0]:
                result.followup = _followup(loaded, cache, settings, full_row.prefill_seconds)
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
