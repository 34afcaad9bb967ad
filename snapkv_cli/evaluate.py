"""snapkv eval needle|multi: accuracy of SnapKV settings against the full cache."""

import dataclasses
import json
import sys
from pathlib import Path
from enum import Enum
from typing import Annotated, Optional

import typer
from snapkv.bits import Bits
from snapkv.config import DEFAULTS
from snapkv.errors import ConfigError
from snapkv.sizes import parse_size, parse_sizes

from .options import (BudgetsOption, DeviceOption, DtypeOption, KernelOption, LengthsOption, ModelOption,
                      PoolingOption, StoreBitsOption, StoreKeepOption, StoreMethodOption, WindowOption, settings_from)

app = typer.Typer(help="Accuracy of SnapKV settings against the full cache.", no_args_is_help=True,
                  rich_markup_mode=None)


class EvalMode(str, Enum):
    query_aware = "query-aware"
    document_window = "document-window"


ModesOption = Annotated[list[EvalMode], typer.Option(
    "--mode", "--modes", help="SnapKV modes to compare with the full cache (repeat the option for several).")]
BOTH_MODES = [EvalMode.query_aware, EvalMode.document_window]


def _settings(budgets: str, modes: list[EvalMode], window: int, kernel: int, pooling: str, store_keep: float | None,
              store_method: str, store_bits: Bits) -> list:
    from snapkv.evaluation import EvalSetting

    base = settings_from(DEFAULTS.budget, window, kernel, pooling, store_keep=store_keep, store_method=store_method,
                         store_bits=store_bits)
    chosen = tuple(dict.fromkeys(mode.value for mode in modes))
    return EvalSetting.grid(parse_sizes(budgets, name="--budget"), base, modes=chosen)


def _heatmaps(result, folder: Path) -> list[Path]:
    from .render import pyplot

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, grid in result.found.items():
        figure, axes = plt.subplots(figsize=(1 + 0.5 * len(result.depths), 1 + 0.5 * len(result.lengths)))
        axes.imshow([[1.0 if cell else 0.0 for cell in row] for row in grid], cmap="RdYlGn", vmin=0, vmax=1,
                    aspect="auto")
        axes.set_xticks(range(len(result.depths)), [f"{d:.0%}" for d in result.depths], rotation=45)
        axes.set_yticks(range(len(result.lengths)), [str(n) for n in result.lengths])
        axes.set(xlabel="needle depth", ylabel="document tokens",
                 title=f"{name}: {result.accuracy(name):.0%} found")
        figure.tight_layout()
        path = folder / f"needle-{name.replace(' ', '-')}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written


@app.command()
def needle(
    lengths: LengthsOption = "1k,2k,4k,7k",
    depths: str = typer.Option("0,10,20,30,40,50,60,70,80,90,100", help="Needle depths in percent, comma-separated."),
    budgets: BudgetsOption = "512,1024",
    modes: ModesOption = BOTH_MODES,
    model: ModelOption = None,
    window: WindowOption = DEFAULTS.window,
    kernel: KernelOption = DEFAULTS.kernel,
    pooling: PoolingOption = DEFAULTS.pooling,
    store_keep: StoreKeepOption = DEFAULTS.store_keep,
    store_method: StoreMethodOption = DEFAULTS.store_method,
    store_bits: StoreBitsOption = DEFAULTS.store_bits,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    plot_dir: Optional[Path] = typer.Option(None, "--plot", "--plot-dir",
                                            help="Write one heatmap PNG per setting into this folder."),
) -> None:
    """The paper's needle-in-a-haystack grid: full cache vs SnapKV, per length and depth."""
    from rich.table import Table

    from snapkv.evaluation import needle_grid

    from .render import load_with_status, stderr_console, stdout_console

    length_values = parse_sizes(lengths, name="--length", minimum=16)
    depth_values = [d / 100 for d in parse_sizes(depths, name="--depths", minimum=0)]
    if any(not 0 <= d <= 1 for d in depth_values):
        raise ConfigError("--depths are percentages from 0 to 100")
    settings = _settings(budgets, modes, window, kernel, pooling, store_keep, store_method, store_bits)
    err = stderr_console()
    loaded, _ = load_with_status(err, model, device, dtype)
    too_long = [n for n in length_values if loaded.context_length and n + 200 > loaded.context_length]
    if too_long:
        raise ConfigError(f"{loaded.name} holds {loaded.context_length} tokens; lengths {too_long} leave no room")
    with err.status("Evaluating...") as status:
        result = needle_grid(loaded, length_values, depth_values, settings,
                             on_cell=lambda name, n, d: status.update(f"{name}: {n} tokens, depth {d:.0%}"))
    written = _heatmaps(result, plot_dir) if plot_dir else []
    if as_json:
        data = dataclasses.asdict(result)
        data["accuracy"] = {name: result.accuracy(name) for name in result.found}
        sys.stdout.write(json.dumps(data) + "\n")
        return
    table = Table(title=f"needle found, {loaded.name}")
    table.add_column("setting")
    for length in result.lengths:
        table.add_column(str(length), justify="right")
    table.add_column("all", justify="right")
    for name, grid in result.found.items():
        table.add_row(name, *[f"{sum(row)}/{len(row)}" for row in grid], f"{result.accuracy(name):.0%}")
    stdout_console().print(table)
    for path in written:
        err.print(f"wrote {path}", markup=False)


@app.command()
def multi(
    tokens: str = typer.Option("4k", "--length", "--tokens", help="Document length in tokens: 4000, 4k (k = 1024)."),
    facts: int = typer.Option(8, min=1, max=10, help="How many different facts the document holds."),
    budgets: BudgetsOption = "512,1024",
    modes: ModesOption = BOTH_MODES,
    model: ModelOption = None,
    window: WindowOption = DEFAULTS.window,
    kernel: KernelOption = DEFAULTS.kernel,
    pooling: PoolingOption = DEFAULTS.pooling,
    store_keep: StoreKeepOption = DEFAULTS.store_keep,
    store_method: StoreMethodOption = DEFAULTS.store_method,
    store_bits: StoreBitsOption = DEFAULTS.store_bits,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """One document with several facts, compressed once and saved; every question asked against the one cache."""
    from rich.table import Table

    from snapkv.evaluation import many_questions

    from .render import load_with_status, stderr_console, stdout_console

    settings = _settings(budgets, modes, window, kernel, pooling, store_keep, store_method, store_bits)
    err = stderr_console()
    loaded, _ = load_with_status(err, model, device, dtype)
    with err.status("Evaluating...") as status:
        result = many_questions(loaded, parse_size(tokens, name="--length", minimum=16), facts, settings,
                                on_answer=lambda name, fact: status.update(f"{name}: {fact.question}"))
    if as_json:
        data = dataclasses.asdict(result)
        data["accuracy"] = {name: result.accuracy(name) for name in result.found}
        sys.stdout.write(json.dumps(data) + "\n")
        return
    table = Table(title=f"{len(result.facts)} questions on one {result.tokens}-token document, {loaded.name}")
    for column in ("setting", "found", "accuracy", "vs full", "file MiB"):
        table.add_column(column, justify="right")
    full = result.accuracy("full") or 1.0
    for name in result.found:
        table.add_row(name, f"{sum(result.found[name])}/{len(result.facts)}", f"{result.accuracy(name):.0%}",
                      f"{result.accuracy(name) / full:.0%}", f"{result.file_bytes[name] / 2**20:.1f}")
    stdout_console().print(table)
