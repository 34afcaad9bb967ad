"""snapkv eval needle|multi: accuracy of SnapKV settings against the full cache."""

import dataclasses
import json
import sys
from pathlib import Path
from enum import Enum
from typing import Annotated, Optional

import typer
from snapkv.compression.config import DEFAULTS
from snapkv.base.errors import ConfigError
from snapkv.base.sizes import parse_size, parse_sizes

from .options import (BudgetsOption, DeviceOption, DtypeOption, LengthsOption, ModelOption, settings_from,
                      settings_options)
from .usage import PlainCommand

app = typer.Typer(help="Accuracy of SnapKV settings against the full cache.", no_args_is_help=True,
                  rich_markup_mode=None)


class EvalMode(str, Enum):
    query_aware = "query-aware"
    document_window = "document-window"


ModesOption = Annotated[list[EvalMode], typer.Option(
    "--mode", "--modes", help="SnapKV modes to compare with the full cache (repeat the option for several).")]
BOTH_MODES = [EvalMode.query_aware, EvalMode.document_window]


EVAL_SETTINGS = ("window", "kernel", "pooling", "store_keep", "store_method", "store_bits")  # the budgets are a grid


def _settings(budgets: str, modes: list[EvalMode], settings_given: dict) -> list:
    from snapkv.measure.evaluation import EvalSetting

    base = settings_from(DEFAULTS.budget, **settings_given)
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


@app.command(cls=PlainCommand)
@settings_options(*EVAL_SETTINGS)
def needle(
    lengths: LengthsOption = "1k,2k,4k,7k",
    depths: str = typer.Option("0,10,20,30,40,50,60,70,80,90,100", help="Needle depths in percent, comma-separated."),
    budgets: BudgetsOption = "512,1024",
    modes: ModesOption = BOTH_MODES,
    model: ModelOption = None,
    settings_given: dict = None,  # the settings options EVAL_SETTINGS (snapkv_cli.options.settings_options)
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    plot_dir: Optional[Path] = typer.Option(None, "--plot", "--plot-dir",
                                            help="Write one heatmap PNG per setting into this folder."),
) -> None:
    """The paper's needle-in-a-haystack grid: full cache vs SnapKV, per length and depth."""
    from rich.table import Table

    from snapkv.measure.evaluation import needle_grid

    from .consoles import working
    from .render import load_with_status, stderr_console, stdout_console

    length_values = parse_sizes(lengths, name="--length", minimum=16)
    depth_values = [d / 100 for d in parse_sizes(depths, name="--depths", minimum=0)]
    if any(not 0 <= d <= 1 for d in depth_values):
        raise ConfigError("--depths are percentages from 0 to 100")
    settings = _settings(budgets, modes, settings_given)
    err = stderr_console()
    loaded, _ = load_with_status(err, model, device, dtype)
    too_long = [n for n in length_values if loaded.context_length and n + 200 > loaded.context_length]
    if too_long:
        raise ConfigError(f"{loaded.name} holds {loaded.context_length} tokens; lengths {too_long} leave no room")
    with working(err, "Evaluating...") as update:
        result = needle_grid(loaded, length_values, depth_values, settings,
                             on_cell=lambda name, n, d: update(f"{name}: {n} tokens, depth {d:.0%}"))
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


@app.command(cls=PlainCommand)
@settings_options(*EVAL_SETTINGS)
def multi(
    tokens: str = typer.Option("4k", "--length", "--tokens", help="Document length in tokens: 4000, 4k (k = 1024)."),
    facts: int = typer.Option(8, min=1, max=10, help="How many different facts the document holds."),
    budgets: BudgetsOption = "512,1024",
    modes: ModesOption = BOTH_MODES,
    model: ModelOption = None,
    settings_given: dict = None,  # the settings options EVAL_SETTINGS (snapkv_cli.options.settings_options)
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """One document with several facts, compressed once and saved; every question asked against the one cache."""
    from rich.table import Table

    from snapkv.measure.evaluation import many_questions

    from .consoles import working
    from .render import load_with_status, stderr_console, stdout_console

    settings = _settings(budgets, modes, settings_given)
    err = stderr_console()
    loaded, _ = load_with_status(err, model, device, dtype)
    with working(err, "Evaluating...") as update:
        result = many_questions(loaded, parse_size(tokens, name="--length", minimum=16), facts, settings,
                                on_answer=lambda name, fact: update(f"{name}: {fact.question}"))
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


def _fidelity_plot(result, path: Path) -> Path:
    from .render import pyplot

    plt = pyplot()
    figure, (storage, compression) = plt.subplots(1, 2, figsize=(12, 4.5))
    for axes, comparisons, title in ((storage, result.storage, f"stored tiers vs 16 bits, budget {result.budget}"),
                                     (compression, result.compression, "16 bits cut per question vs the full cache")):
        names = [c.setting for c in comparisons]
        places = range(len(names))
        axes.bar([p - 0.2 for p in places], [100 * c.agreement for c in comparisons], 0.4, label="answers identical %")
        axes.bar([p + 0.2 for p in places], [100 * c.changed_share for c in comparisons], 0.4,
                 label="answers with a fact changed %")
        for place, comparison in zip(places, comparisons):
            if comparison.bytes_ratio and comparison.bytes_ratio != 1:
                axes.annotate(f"{comparison.bytes_ratio:.1f}x smaller", (place, 101), ha="center", fontsize=8)
        axes.set_xticks(list(places), names, rotation=30, ha="right")
        axes.set(ylim=(0, 110), title=title)
        axes.legend(fontsize=8, loc="center right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _comparison_table(title: str, comparisons: list, with_bytes: bool):
    from rich.table import Table

    table = Table(title=title)
    columns = ["setting", "asked", "same", "changed", "of right", "lost", "gained", "vs floor", "s/answer",
               "how changed"]
    for column in columns + (["smaller"] if with_bytes else []):
        table.add_column(column, justify="left" if column in ("setting", "how changed") else "right",
                         overflow="fold")
    for c in comparisons:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(c.kinds.items(), key=lambda item: -item[1])
                          if kind != "same")
        floor = "-" if c.beyond_floor is None else (
            f"{'beyond' if c.beyond_floor else 'within'} (p {min(c.p_changed_right, c.p_lost):.2g})")
        row = [c.setting, str(c.questions), f"{c.agreement:.1%}", f"{c.changed} ({c.changed_share:.1%})",
               str(c.changed_right), str(c.lost), str(c.gained), floor, f"{c.seconds_per_answer:.2f}", kinds or "-"]
        table.add_row(*row, *([f"{c.bytes_ratio:.2f}x"] if with_bytes else []))
    return table


FLOOR_DTYPES = ("bfloat16", "float32")  # a noise floor computed with the model in another dtype
DEFAULT_CUT = f"{DEFAULTS.method}{'+words' if DEFAULTS.whole_words else ''}"  # the cut `ask` makes, as --cut-methods

# The benchmark's own documents (snapkv/io/data/fidelity), as --help describes them; a test keeps this true.
SHIPPED_DOCUMENTS = "19 documents shipped with snapkv, 1k-7.2k tokens, 491 questions"
# The stored tiers compared by default: the whole prompt at every precision that measured well or is smaller.
FIDELITY_TIERS = "16/8,8,8r/8,8r/4g32,16/4,8/4,4g32,4/3,3/2+20%@8/4"  # the default (8) and the tiers around it


@app.command(cls=PlainCommand)
def fidelity(
    tiers: str = typer.Option(
        FIDELITY_TIERS, help="Stored tiers to compare with the 16-bit cache (--store-bits values), "
        "comma-separated; BITS~SHARE keeps that share of the document's positions, ranked by the pseudo-question "
        "probes, in BITS (8~45%: as --store-keep 0.45); the default tier is always included; 'none' for none."),
    budget: int = typer.Option(DEFAULTS.budget, parser=lambda v: v if isinstance(v, int) else parse_size(v, name="--budget"),
                               metavar="SIZE", help="Per-question budget the stored tiers are compared at."),
    budgets: str = typer.Option(
        "", "--cut-budgets", help="Per-question cuts compared with the full cache: budgets, or shares of the prompt "
        "such as 25%, comma-separated (default: --budget)."),
    methods: str = typer.Option(DEFAULT_CUT, "--cut-methods", help="The per-question cut's methods, comma-separated: "
                                "snapkv, chunks (whole chunks of 8 positions kept by their mean score); +words "
                                "after either keeps words whole (snapkv+words), +numbers after +words a number with the "
                                "words either side; +pyramid keeps more in the lower layers and fewer in the upper ones, "
                                "as many in all (snapkv+words+pyramid)."),
    kernels: str = typer.Option("", "--cut-kernels", help="Pooling widths the cuts are compared at, comma-separated "
                                "(default: the default's)."),
    floor: str = typer.Option("torch", help="The noise floor: the same 16-bit file answered again by another engine "
                              "(torch, native, reference) or with the model in another dtype (bfloat16, float32), "
                              "against the default's answers; every setting is judged against it. '' for none."),
    documents: Optional[Path] = typer.Option(
        None, "--documents", help="A folder of NAME.txt documents with NAME.json questions (default: the "
        f"{SHIPPED_DOCUMENTS})."),
    only: str = typer.Option("", help="Only these documents, by name, comma-separated."),
    needle_lengths: str = typer.Option("2k,4k,7k", help="The needle grid's lengths, comma-separated ('' for none)."),
    needle_depths: str = typer.Option("10,40,60,90", help="The needle grid's depths in percent, comma-separated."),
    model: ModelOption = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="Write the results (every answer) as JSON here, updated after each document."),
    more: bool = typer.Option(False, "--more", help="Only the settings asked for, not the full cache: answers to add to "
                              "an earlier run's --output of the same documents (snapkv.measure.published.merged)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a bar chart PNG here."),
) -> None:
    """Storage and compression fidelity: do answers keep their facts?

    Every question is answered greedily (up to 64 tokens, compared whole) from the 16-bit cache cut per question to
    --budget (the reference), from each stored tier with the same cut (storage fidelity: only what the file stores
    differs), from the 16-bit cache at each --cut-budgets and --cut-methods, and from the full cache (compression
    fidelity: what the cut costs). Per question: the facts (numbers in their order, capitalised names, lower-case
    facts such as million, rose/fell, currencies) the other answer lacks, alters, adds or reorders; whether the
    answers are identical; whether each states the expected fact. The noise floor (--floor) is the full cache
    answered by a second computation; a setting that loses facts, or changes answers the reference had right,
    more often than the floor by more than chance (Fisher's exact test, one-sided, p < 0.05) is marked beyond it.
    Each tier is saved to a file and loaded back, and all of a document's questions are asked of that file.
    """
    from snapkv.base.atomic import write_atomically
    from snapkv.base.bits import parse_tier
    from snapkv.compression.config import DEFAULT_SYSTEM, ENGINE_CHOICES
    from snapkv.compression.methods import METHODS
    from snapkv.measure.fidelity import (FULL, cut_method_parts, load_documents, needle_documents, parse_cut_sizes,
                                         run_fidelity, settings_for)

    from .consoles import working
    from .render import load_with_status, stderr_console, stdout_console

    try:
        stored_tiers = [] if tiers.strip().lower() == "none" else [parse_tier(t) for t in tiers.split(",") if t.strip()]
    except ValueError as error:
        raise ConfigError(f"--tiers: {error}") from None
    if stored_tiers:
        stored_tiers = list(dict.fromkeys([*stored_tiers, (DEFAULTS.store_bits, None)]))
    stored_tiers = [tier for tier in stored_tiers if tier != (16, None)]
    try:
        cut_sizes = parse_cut_sizes(budgets) if budgets.strip() else [(budget, None)]
    except ValueError as error:
        raise ConfigError(f"--cut-budgets: {error}") from None
    if not cut_sizes:
        raise ConfigError("--cut-budgets needs at least one budget or share")
    cut_methods = [m.strip() for m in methods.split(",") if m.strip()] or [DEFAULT_CUT]
    try:
        names = [cut_method_parts(m)[0] for m in cut_methods]
    except ValueError as error:
        raise ConfigError(f"--cut-methods: {error}") from None
    unknown = [m for m, name in zip(cut_methods, names) if name not in METHODS or not METHODS[name].scores_during_prefill]
    if unknown:
        raise ConfigError(f"--cut-methods: {', '.join(unknown)} cannot cut per question; use snapkv or chunks")
    cut_kernels = parse_sizes(kernels, name="--cut-kernels") if kernels.strip() else None
    if any(k % 2 == 0 for k in cut_kernels or []):
        raise ConfigError("--cut-kernels are odd numbers")
    floor = floor.strip().lower()
    if floor and floor not in ENGINE_CHOICES + FLOOR_DTYPES:
        raise ConfigError(f"--floor is one of {', '.join(ENGINE_CHOICES + FLOOR_DTYPES)}, or '' for none; "
                          f"not {floor!r}")
    if documents is not None and not documents.is_dir():
        raise ConfigError(f"--documents: {documents} is not a folder")
    try:
        chosen = load_documents(documents, [name.strip() for name in only.split(",") if name.strip()])
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"--documents: {error}") from None
    lengths = parse_sizes(needle_lengths, name="--needle-lengths", minimum=16) if needle_lengths.strip() else []
    depths = [d / 100 for d in parse_sizes(needle_depths, name="--needle-depths", minimum=0)] if lengths else []
    if any(not 0 <= d <= 1 for d in depths):
        raise ConfigError("--needle-depths are percentages from 0 to 100")
    err = stderr_console()
    loaded, _ = load_with_status(err, model, device, dtype)
    models = {}
    if floor in FLOOR_DTYPES:
        if str(loaded.dtype).removeprefix("torch.") == floor:
            raise ConfigError(f"--floor {floor} is the dtype the answers are computed in already; give --dtype")
        models[floor], _ = load_with_status(err, model, device, floor)
    chosen += needle_documents(loaded.tokenizer, lengths, depths)
    partial = {"documents": []}

    def keep(record: dict) -> None:
        partial["documents"].append(record)
        if output is not None:
            text = json.dumps(partial)
            write_atomically(output, lambda temp: temp.write_text(text, encoding="utf-8"), "the results")

    questions = sum(len(d.questions) for d in chosen)
    settings = settings_for(stored_tiers, budget, cut_sizes, cut_methods, floor, cut_kernels)
    if more:
        settings = [s for s in settings if s != FULL]
    err.print(f"{len(chosen)} documents, {questions} questions, {len(settings)} settings: "
              f"{', '.join(s.name for s in settings)}", markup=False, soft_wrap=True)
    with working(err, "Evaluating...") as update:
        result = run_fidelity(loaded, chosen, stored_tiers, budget, on_progress=update, on_document=keep,
                              settings=settings, system=DEFAULT_SYSTEM, models=models)
    data = result.to_dict()
    if output is not None:
        text = json.dumps(data, indent=1)
        write_atomically(output, lambda temp: temp.write_text(text, encoding="utf-8"), "the results")
    written = _fidelity_plot(result, plot) if plot else None
    if as_json:
        sys.stdout.write(json.dumps(data) + "\n")
    else:
        out = stdout_console()
        if result.floor is not None:
            out.print(_comparison_table(f"noise floor: the full cache answered in {floor} against the default's",
                                        [result.floor], with_bytes=False))
        if result.storage:
            out.print(_comparison_table(f"storage fidelity: each tier against 16 bits, cut to {budget} per question "
                                        f"({loaded.name}, {data['dtype']})", result.storage, with_bytes=True))
        if result.compression:  # none under --more: no full cache was asked
            out.print(_comparison_table("compression fidelity: 16 bits cut per question against the full cache",
                                        result.compression, with_bytes=False))
        err.print(f"{questions} questions in {result.seconds / 60:.1f} min on {result.cpu}", markup=False)
    if written:
        err.print(f"wrote {written}", markup=False, soft_wrap=True)
