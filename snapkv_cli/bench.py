"""snapkv bench: the full cache and SnapKV side by side, in one process, as a table, JSON or a plot."""

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from snapkv.compression.config import DEFAULTS
from snapkv.base.sizes import parse_sizes

from .options import (BudgetsOption, DeviceMapOption, DeviceOption, DtypeOption, EngineOption, LengthsOption,
                      ModelOption, settings_from, settings_options)


def _table(result):
    from rich.table import Table

    table = Table(title=f"{result.model} on {result.device}, {result.dtype}")
    kind = "CUDA peak" if result.device.startswith("cuda") else "RSS+"
    for column in ("length", "method", "budget", "prefill s (tier)", "TTFT s", "decode ms/tok", "floor ms (x)",
                   "KV MiB", "stored MiB", f"prefill {kind} MiB", f"answer {kind} MiB", "needle", "engine"):
        table.add_column(column, justify="right")
    for row in result.rows:
        if row.estimated:
            table.add_row(str(row.length), row.method, "-", f"~{row.prefill_seconds:.0f} (estimate)",
                          *["-"] * 9)
            continue
        needle = "-" if row.needle_found is None else ("found" if row.needle_found else "missed")
        method = row.method + ("-qa" if row.query_aware else "") + (f" chunks {row.prefill_chunk}"
                                                                     if row.prefill_chunk else "")
        tier = f" ({row.tier_seconds:.2f})" if row.tier_seconds >= 0.005 else ""
        tier += ", shared" if row.prefill_shared else ""
        table.add_row(str(row.length), method, str(row.budget or "-"), f"{row.prefill_seconds:.2f}{tier}",
                      f"{row.ttft_seconds:.3f}", f"{row.decode_ms_per_token:.1f}",
                      f"{row.floor_ms_per_token:.1f} ({row.above_floor:.1f}x)", f"{row.kv_bytes / 2**20:.1f}",
                      f"{row.stored_bytes / 2**20:.1f}", f"{row.peak_memory_bytes / 2**20:.0f}",
                      f"{row.answer_peak_memory_bytes / 2**20:.0f}", needle,
                      "/".join(filter(None, (row.engine.get("name"), row.engine.get("kernels")))))
    return table


def _plot(result, path: Path) -> None:
    from snapkv.measure.bench import series_name

    from .render import pyplot

    plt = pyplot()
    figure, panels = plt.subplots(1, 4, figsize=(18, 4))
    measured = [row for row in result.rows if not row.estimated]
    columns = (("prefill_seconds", 1, "prefill s", "Prefill time"),
               ("decode_ms_per_token", 1, "decode ms / token", "Decode time"),
               ("kv_bytes", 2**20, "KV cache MiB", "KV memory while decoding"),
               ("peak_memory_bytes", 2**20, "peak MiB", "Prefill peak memory"))
    for label in sorted({series_name(row) for row in measured}):
        rows = [r for r in measured if series_name(r) == label]
        for axes, (key, unit, _, _) in zip(panels, columns):
            axes.plot([r.length for r in rows], [getattr(r, key) / unit for r in rows], marker="o", label=label)
    for axes, (_, _, ylabel, title) in zip(panels, columns):
        axes.set(xlabel="prompt tokens", ylabel=ylabel, title=title, xscale="log", yscale="log")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle(f"{result.model} on {result.device} ({result.dtype})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


@settings_options("window", "kernel", "pooling", "query_aware", "store_keep", "store_method", "store_bits")
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
    weight_blocks: Optional[str] = typer.Option(
        None, help="With --random-weights: the weights as random blocks of this GGUF type (Q4_K, Q6_K, Q8_0, ...), "
                   "read as a GGUF file's are: the speed and memory of that shape in such a file (CPU only)."),
    settings_given: dict = None,  # the settings options (snapkv_cli.options.settings_options) but the budget
    decode_tokens: int = typer.Option(32, min=2, help="Tokens decoded to time decode speed."),
    repeats: int = typer.Option(3, min=1, help="Answers timed per method, in turn; the medians are reported."),
    allow_extrapolation: bool = typer.Option(False, help="Allow lengths past the model's context (speed and memory only)."),
    device: DeviceOption = "auto",
    device_map: DeviceMapOption = None,
    dtype: DtypeOption = "auto",
    engine: EngineOption = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG of decode time and KV memory against length."),
    max_prefill_seconds: float = typer.Option(
        600.0, min=0.0, help="A length whose exact prefill is estimated (from a short warm-up prefill) to take "
                             "longer, or not to fit in memory, gets SnapKV prefilled in chunks and the full "
                             "cache's estimate instead of a run."),
    prefill_chunk: int = typer.Option(4096, min=64, help="Chunk size of such a prefill, in tokens."),
) -> None:
    """Measure the full cache against SnapKV: prefill, first token, decode speed, memory, the needle; and a follow-up
    question from the saved cache (load + first token, the median of 3 rounds) against prefilling again."""
    from snapkv.measure.bench import run_bench
    from snapkv.engine.models import random_weights_model

    from .consoles import working
    from .render import load_with_status, stderr_console, stdout_console

    lengths = parse_sizes(length, name="--length", minimum=16)
    budgets = parse_sizes(budget, name="--budget")
    settings = settings_from(budgets[0], **settings_given)
    err = stderr_console()
    if weight_blocks is not None and random_weights is None:
        raise typer.BadParameter("--weight-blocks goes with --random-weights (a real model's blocks are its file's)",
                                 param_hint="--weight-blocks")
    if random_weights is not None:
        with working(err, "Building a random-weights model..."):
            loaded = random_weights_model(str(random_weights), device=device, dtype=dtype,
                                          tokenizer=str(tokenizer) if tokenizer else None,
                                          weight_blocks=weight_blocks)
        err.print("note: random weights: answers are meaningless; speed and memory are real", markup=False)
    else:
        loaded, _ = load_with_status(err, model, device, dtype, device_map)
    with working(err, "Measuring...") as update:
        result = run_bench(loaded, lengths, budgets, settings=settings, decode_tokens=decode_tokens,
                           repeats=repeats,
                           allow_extrapolation=allow_extrapolation, random_weights=random_weights is not None,
                           max_prefill_seconds=max_prefill_seconds, prefill_chunk=prefill_chunk, engine=engine,
                           on_row=lambda row: update(f"Measured {row.method} at {row.length} tokens..."),
                           on_progress=update)
    if plot is not None:
        _plot(result, plot)
    if as_json:
        data = dataclasses.asdict(result)
        for row, row_data in zip(result.rows, data["rows"]):
            row_data["above_floor"] = row.above_floor
        if result.followup:
            data["followup"]["speedup"] = result.followup.speedup
        sys.stdout.write(json.dumps(data) + "\n")
        return
    stdout_console().print(_table(result))
    stdout_console().print(
        f"floor: (weights {result.weight_bytes / 2**20:.0f} MiB + KV decoded against) per token at the read "
        f"bandwidth measured in this run, {result.read_bandwidth / 1e9:.1f} GB/s; (x) = decode / floor")
    stdout_console().print(f"weights: {result.weights}", markup=False)
    for name, fitted in result.growth.items():
        stdout_console().print(f"growth with length, {name}: " + ", ".join(
            f"{key.replace('_', ' ')} ~ n^{exponent:.2f}" for key, exponent in fitted.items()))
    for note in result.notes:
        err.print("note: " + note, markup=False)
    follow = result.followup
    if follow:
        stdout_console().print(
            f"follow-up question at {follow.length} tokens, budget {follow.budget}: load {follow.load_seconds:.3f} s + "
            f"first token {follow.ttft_seconds:.3f} s vs re-prefill {follow.reprefill_seconds:.2f} s = "
            f"{follow.speedup:.1f}x faster ({follow.file_bytes / 2**20:.1f} MiB file; the median of "
            f"{len(follow.round_seconds)} rounds: {', '.join(f'{total:.3f}' for total in follow.round_seconds)} s)")
        if follow.load_split:
            split = follow.load_split
            stdout_console().print(
                f"  load = read {split['read_seconds']:.3f} s + payload check {split['digest_seconds']:.3f} s + restore "
                f"(checks, dequantize, place) {split['restore_seconds']:.3f} s; first token = the question's pass")
