"""The command-line options the commands share, and the settings they build. Defaults come from snapkv.config."""

from typing import Annotated, Literal, Optional

import typer

from snapkv.config import DEFAULTS, SnapKVConfig

ModelOption = Annotated[Optional[str], typer.Option(
    "--model", "-m", envvar="SNAPKV_MODEL",
    help="Hugging Face id (local cache only), model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct.")]
BudgetOption = Annotated[int, typer.Option(help="Positions kept per KV head per layer, the observation window included.")]
WindowOption = Annotated[int, typer.Option(help="Observation window: how many final positions decide what is kept.")]
KernelOption = Annotated[int, typer.Option(help="Width of the pooling over attention scores (odd); wider keeps whole numbers and names.")]
PoolingOption = Annotated[Literal["max", "avg"], typer.Option(help="Pooling of the scores.")]
QueryAwareOption = Annotated[bool, typer.Option(
    "--query-aware/--no-query-aware",
    help="Query-aware: keep the whole prompt's cache and compress it per question, with the question as the "
         "window. Otherwise compress once at prefill with the document's tail as the window.")]
NoCompressOption = Annotated[bool, typer.Option("--no-compress", help="Keep the full cache (the baseline).")]
StoreBudgetOption = Annotated[Optional[int], typer.Option(
    help="Query-aware: positions per head kept in the saved tier (default: the whole prompt); each question "
         "is then cut from that tier.")]
DeviceOption = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")]
DeviceMapOption = Annotated[Optional[Literal["auto", "balanced", "balanced_low_0", "sequential"]], typer.Option(
    help="Spread a model too large for one GPU over several with accelerate. Each layer's cache stays on that "
         "layer's device.")]
DtypeOption = Annotated[Literal["auto", "float32", "bfloat16", "float16"], typer.Option(
    help="auto: bf16 on GPU and on CPUs with bf16 units, else float32.")]
PasswordOption = Annotated[Optional[str], typer.Option(help="Password of an encrypted PDF.")]
TruncateOption = Annotated[Optional[Literal["start", "middle", "end"]], typer.Option(
    help="Cut a document longer than the model's context: the part removed.")]
SkipDigestOption = Annotated[bool, typer.Option(
    "--skip-digest", help="Do not check a saved cache's payload digest when loading it (faster for very "
                          "large files; damage then goes unnoticed).")]

LengthsOption = Annotated[str, typer.Option(
    "--length", "--lengths", help="Prompt lengths in tokens, comma-separated: 7000, 8k, 128k, 1m (k = 1024).")]
BudgetsOption = Annotated[str, typer.Option(
    "--budget", "--budgets", help="SnapKV budgets (positions kept per KV head, window included), comma-separated.")]

# The SnapKVConfig fields a command line sets; `explicit_settings` tells which were typed.
SETTING_OPTIONS = ("budget", "window", "kernel", "pooling", "query_aware", "store_budget", "no_compress")


def settings_from(budget: int = DEFAULTS.budget, window: int = DEFAULTS.window, kernel: int = DEFAULTS.kernel,
                  pooling: str = DEFAULTS.pooling, query_aware: bool = DEFAULTS.query_aware,
                  no_compress: bool = False, store_budget: int | None = None) -> SnapKVConfig | None:
    """The settings a command line asks for; None for --no-compress (the full cache)."""
    if no_compress:
        return None
    return SnapKVConfig(budget=budget, window=window, kernel=kernel, pooling=pooling, query_aware=query_aware,
                        store_budget=store_budget)


def explicit_settings(ctx: typer.Context) -> frozenset[str]:
    """The settings options given on the command line (not left at their defaults)."""
    given = set()
    for name in SETTING_OPTIONS:
        source = ctx.get_parameter_source(name)  # None for an option the command does not have
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            given.add(name)
    return frozenset(given)
