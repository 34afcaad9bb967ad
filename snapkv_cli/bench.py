"""snapkv bench: the full cache and SnapKV side by side, in one process, as a table, JSON or a plot."""

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from snapkv.config import DEFAULTS
from snapkv.sizes import parse_sizes

from .options import (BudgetsOption, DeviceMapOption, DeviceOption, DtypeOption, KernelOption, LengthsOption,
                      ModelOption, PoolingOption, QueryAwareOption, StoreBitsOption, StoreKeepOption,
                      StoreMethodOption, WindowOption, settings_from)


def _table(result):
    from rich.table import Table

    table = Table(title=f"{result.model} on {result.device}, {result.dtype}")
    kind = "CUDA peak" if result.device.startswith("cuda") else "RSS+"
    for column in ("length", "method", "budget", "prefill s (tier)", "TTFT s", "decode ms/tok", "KV MiB",
                   "stored MiB", f"prefill {kind} MiB", f"answer {kind} MiB", "needle"):
        table.add_column(column, justify="right")
    for row in result.rows:
        needle = "-" if row.needle_found is None else ("found" if row.needle_found else "missed")
        method = row.method + ("-qa" if row.query_aware else "")
        tier = f" ({row.tier_seconds:.2f})" if row.tier_seconds >= 0.005 else ""
        table.add_row(str(row.length), method, str(row.budget or "-"), f"{row.prefill_seconds:.2f}{tier}",
                      f"{row.ttft_seconds:.3f}", f"{row.decode_ms_per_token:.1f}", f"{row.kv_bytes / 2**20:.1f}",
                      f"{row.stored_bytes / 2**20:.1f}", f"{row.peak_memory_bytes / 2**20:.0f}",
                      f"{row.answer_peak_memory_bytes / 2**20:.0f}", needle)
    return table


def _plot(result, path: Path) -> None:
    from .render import pyplot

    plt = pyplot()
    figure, (decode, memory) = plt.subplots(1, 2, figsize=(11, 4))
    series = sorted({(row.method, row.budget) for row in result.rows}, key=lambda s: (s[0], s[1] or 0))
    for method, budget in series:
        rows = [r for r in result.rows if (r.method, r.budget) == (method, budget)]
        label = "full cache" if method == "full" else f"SnapKV {budget}"
        decode.plot([r.length for r in rows], [r.decode_ms_per_token for r in rows], marker="o", label=label)
        memory.plot([r.length for r in rows], [r.kv_bytes / 2**20 for r in rows], marker="o", label=label)
    decode.set(xlabel="prompt tokens", ylabel="decode ms / token", title="Decode time")
    memory.set(xlabel="prompt tokens", ylabel="KV cache MiB", title="KV memory while decoding")
    for axes in (decode, memory):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(f"{result.model} on {result.device} ({result.dtype})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def bench(
    length: LengthsOption = "2k",
    budget: BudgetsOption = str(DEFAULTS.budget),
    model: ModelOption = None,
    random_weights: Optional[Path] = typer.Option(
        None, help="A config.json of a real model shape (see samples/configs/) built with random weights: speed "
                   "and memory at lengths no real weights are at hand for; answers are meaningless."),
    tokenizer: Optional[Path] = typer.Option(
        None, help="With --random-weights: a folder of tokenizer files for the prompts (default: the embedded "
                   "model's)."),
    window: WindowOption = DEFAULTS.window,
    kernel: KernelOption = DEFAULTS.kernel,
    pooling: PoolingOption = DEFAULTS.pooling,
    query_aware: QueryAwareOption = DEFAULTS.query_aware,
    store_keep: StoreKeepOption = DEFAULTS.store_keep,
    store_method: StoreMethodOption = DEFAULTS.store_method,
    store_bits: StoreBitsOption = DEFAULTS.store_bits,
    decode_tokens: int = typer.Option(32, min=2, help="Tokens decoded to time decode speed."),
    repeats: int = typer.Option(3, min=1, help="Answers timed per method, in turn; the medians are reported."),
    allow_extrapolation: bool = typer.Option(False, help="Allow lengths past the model's context (speed and memory only)."),
    device: DeviceOption = "auto",
    device_map: DeviceMapOption = None,
    dtype: DtypeOption = "auto",
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG of decode time and KV memory against length."),
) -> None:
    """Measure the full cache against SnapKV: prefill, first token, decode speed, memory, the needle."""
    from snapkv.bench import run_bench
    from snapkv.models import random_weights_model

    from .render import load_with_status, stderr_console, stdout_console

    lengths = parse_sizes(length, name="--length", minimum=16)
    budgets = parse_sizes(budget, name="--budget")
    settings = settings_from(budgets[0], window, kernel, pooling, query_aware, store_keep=store_keep,
                             store_method=store_method, store_bits=store_bits)
    err = stderr_console()
    if random_weights is not None:
        with err.status("Building a random-weights model..."):
            loaded = random_weights_model(str(random_weights), device=device, dtype=dtype,
                                          tokenizer=str(tokenizer) if tokenizer else None)
        err.print("note: random weights: answers are meaningless; speed and memory are real", markup=False)
    else:
        loaded, _ = load_with_status(err, model, device, dtype, device_map)
    with err.status("Measuring...") as status:
        result = run_bench(loaded, lengths, budgets, settings=settings, decode_tokens=decode_tokens,
                           repeats=repeats,
                           allow_extrapolation=allow_extrapolation, random_weights=random_weights is not None,
                           on_row=lambda row: status.update(f"Measured {row.method} at {row.length} tokens..."))
    if plot is not None:
        _plot(result, plot)
    if as_json:
        data = dataclasses.asdict(result)
        if result.followup:
            data["followup"]["speedup"] = result.followup.speedup
        sys.stdout.write(json.dumps(data) + "\n")
        return
    stdout_console().print(_table(result))
    for note in result.notes:
        err.print("note: " + note, markup=False)
    follow = result.followup
    if follow:
        stdout_console().print(
            f"follow-up question at {follow.length} tokens, budget {follow.budget}: load {follow.load_seconds:.3f} s + "
            f"first token {follow.ttft_seconds:.3f} s vs re-prefill {follow.reprefill_seconds:.2f} s = "
            f"{follow.speedup:.1f}x faster ({follow.file_bytes / 2**20:.1f} MiB file)")
