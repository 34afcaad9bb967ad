"""The command-line options the commands share, and the settings they build. Defaults come from snapkv.compression.config."""

import functools
import inspect
from typing import Annotated, Literal, Optional

import typer

from snapkv.base.bits import Bits
from snapkv.compression.config import DEFAULT_SYSTEM, DEFAULTS, SnapKVConfig
from snapkv.base.sizes import parse_size


def size(name: str, minimum: int = 1):
    """A parser for an option that takes a size: 7000, 8k, 1m (k = 1024)."""
    return lambda value: value if isinstance(value, int) else parse_size(value, name=name, minimum=minimum)


MaxTokensOption = Annotated[int, typer.Option(parser=size("--max-new-tokens"), metavar="SIZE",
                                              help="Longest answer, in tokens.")]
ModelOption = Annotated[Optional[str], typer.Option(
    "--model", "-m", envvar="SNAPKV_MODEL", metavar="MODEL",
    help="Hugging Face id (local cache only), model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct.")]
BudgetOption = Annotated[int, typer.Option(
    parser=size("--budget"), metavar="SIZE",
    help="Positions kept per KV head per layer for each answer, the window included (1k = 1024). A document up to "
         "the budget is answered from all of it.")]
WindowOption = Annotated[int, typer.Option(
    parser=size("--window"), metavar="SIZE", help="Observation window: how many final positions decide what is kept.")]
KernelOption = Annotated[int, typer.Option(metavar="N", help="Width of the pooling over attention scores (odd).")]
PoolingOption = Annotated[Literal["max", "avg"], typer.Option(help="Pooling of the scores.")]
WholeWordsOption = Annotated[bool, typer.Option(
    "--whole-words/--token-by-token", help="Cut keeps each word (number, code, name) whole, or ranks tokens.")]
QueryAwareOption = Annotated[bool, typer.Option(
    "--query-aware/--no-query-aware",
    help="Save a stored tier and cut it to --budget per question, the question as the window; or compress once "
         "at prefill, the document's tail as the window (smaller file, fewer facts found).")]
NoCompressOption = Annotated[bool, typer.Option("--no-compress", help="Keep the full cache (the baseline).")]
StoreBudgetOption = Annotated[Optional[int], typer.Option(
    parser=size("--store-budget"), metavar="SIZE",
    help="Query-aware: the saved tier as positions per head instead of a share (--store-keep); each question "
         "is then cut from that tier.")]
StoreKeepOption = Annotated[Optional[float], typer.Option(
    min=0.0, max=1.0, metavar="SHARE",
    help="Query-aware: the share of the document's positions the saved file keeps, chosen by --store-method. "
         "Default: all of them.")]
StoreMethodOption = Annotated[Literal["reconstruction", "snapkv", "pseudo-question", "key-norm"], typer.Option(
    help="How the saved tier's positions are chosen when --store-keep or --store-budget drops some.")]
def _bits(value):
    """A parser for --store-bits: 8, KEYS/VALUES as 4/3, a kind's form as 8r/8, or REST+SHARE%@SHARP as 3/2+20%@8/4."""
    try:
        return Bits.parse(value)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


StoreBitsOption = Annotated[Bits, typer.Option(
    parser=_bits, metavar="BITS",
    help="Bits per saved key and value: 16, 8, 4, 3, 2, KEYS/VALUES (16/8); r, u, gN after a kind's bits: "
         "rotated, unrotated, groups of N (8r/8); a sharper share (3/2+20%@8/4). Answers: `snapkv info FILE`.")]
PrefillChunkOption = Annotated[Optional[int], typer.Option(
    parser=size("--prefill-chunk"), metavar="SIZE",
    help="Prefill in chunks of SIZE tokens, cut back after each: memory bounded, time linear in length, fewer "
         "facts found than the exact prefill (README).")]
EngineOption = Annotated[Optional[Literal["auto", "native", "torch", "compiled", "reference"]], typer.Option(
    "--engine", envvar="SNAPKV_ENGINE",
    help="What runs the model; auto: the fastest that applies, reference: its own forward. --json says which ran.")]
DeviceOption = Annotated[str, typer.Option(metavar="DEVICE", help="auto, cpu, cuda or cuda:N.")]
DeviceMapOption = Annotated[Optional[Literal["auto", "balanced", "balanced_low_0", "sequential"]], typer.Option(
    help="Spread a model too large for one GPU over several with accelerate. Each layer's cache stays on that "
         "layer's device.")]
DtypeOption = Annotated[Literal["auto", "float32", "bfloat16", "float16"], typer.Option(
    help="auto: bf16 on GPU, bf16 prefill on CPUs with bf16 units, else float32.")]
SystemOption = Annotated[Optional[str], typer.Option(
    "--system", envvar="SNAPKV_SYSTEM", metavar="TEXT",
    help=f'The system message documents are prompted with (default: "{DEFAULT_SYSTEM}"; "" for the model\'s own). '
         "Part of the cache key; a saved .snapkv file keeps the one it was made with.")]
PasswordOption = Annotated[Optional[str], typer.Option(metavar="TEXT", help="Password of an encrypted PDF.")]
TruncateOption = Annotated[Optional[Literal["start", "middle", "end"]], typer.Option(
    help="Cut a document longer than the model's context: the part removed.")]
SkipDigestOption = Annotated[bool, typer.Option(
    "--skip-digest", help="Do not check a saved cache's checksum when loading it (damage then goes unnoticed).")]

LengthsOption = Annotated[str, typer.Option(
    "--length", "--lengths", help="Prompt lengths in tokens, comma-separated: 7000, 8k, 128k, 1m (k = 1024).")]
BudgetsOption = Annotated[str, typer.Option(
    "--budget", "--budgets", help="SnapKV budgets (positions kept per KV head, window included), comma-separated.")]

# The options that set SnapKVConfig's fields, defined once: name -> (option, default). Commands take them with
# @settings_options; `explicit_settings` tells which were typed.
SETTINGS_OPTIONS = {
    "budget": (BudgetOption, DEFAULTS.budget),
    "window": (WindowOption, DEFAULTS.window),
    "kernel": (KernelOption, DEFAULTS.kernel),
    "pooling": (PoolingOption, DEFAULTS.pooling),
    "whole_words": (WholeWordsOption, DEFAULTS.whole_words),
    "query_aware": (QueryAwareOption, DEFAULTS.query_aware),
    "store_keep": (StoreKeepOption, DEFAULTS.store_keep),
    "store_method": (StoreMethodOption, DEFAULTS.store_method),
    "store_bits": (StoreBitsOption, DEFAULTS.store_bits),
    "prefill_chunk": (PrefillChunkOption, None),
    "store_budget": (StoreBudgetOption, DEFAULTS.store_budget),
    "no_compress": (NoCompressOption, False),
}


def settings_options(*names: str):
    """A command decorator: the settings options `names` (every one by default) stand where the command's parameter
    `settings_given` stands, each an option of its own to typer; the command is called with `settings_given`, their
    values by name (for settings_from)."""
    chosen = names or tuple(SETTINGS_OPTIONS)

    def decorate(command):
        signature = inspect.signature(command)
        parameters = []
        for parameter in signature.parameters.values():
            if parameter.name == "settings_given":
                parameters += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=SETTINGS_OPTIONS[name][1],
                                                 annotation=SETTINGS_OPTIONS[name][0]) for name in chosen]
            else:
                parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))

        @functools.wraps(command)
        def with_settings(**values):
            return command(**{name: value for name, value in values.items() if name not in chosen},
                           settings_given={name: values[name] for name in chosen})

        with_settings.__signature__ = signature.replace(parameters=parameters)
        return with_settings

    return decorate


STORE_OPTIONS = ("store_budget", "store_keep", "store_method", "store_bits")


def settings_from(budget: int = DEFAULTS.budget, window: int = DEFAULTS.window, kernel: int = DEFAULTS.kernel,
                  pooling: str = DEFAULTS.pooling, query_aware: bool = DEFAULTS.query_aware,
                  no_compress: bool = False, store_budget: int | None = None,
                  store_keep: float | None = DEFAULTS.store_keep, store_method: str = DEFAULTS.store_method,
                  store_bits: Bits = DEFAULTS.store_bits, prefill_chunk: int | None = None,
                  whole_words: bool = DEFAULTS.whole_words) -> SnapKVConfig | None:
    """The settings a command line asks for; None for --no-compress (the full cache)."""
    if no_compress:
        return None
    if store_budget is not None:
        store_keep = None  # positions per head instead of the default share
    return SnapKVConfig(budget=budget, window=window, kernel=kernel, pooling=pooling, query_aware=query_aware,
                        store_budget=store_budget, store_keep=store_keep, store_method=store_method,
                        store_bits=store_bits, prefill_chunk=prefill_chunk, whole_words=whole_words)


def explicit_settings(ctx: typer.Context) -> frozenset[str]:
    """The settings options given on the command line (not left at their defaults)."""
    given = set()
    for name in SETTINGS_OPTIONS:
        source = ctx.get_parameter_source(name)  # None for an option the command does not have
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            given.add(name)
    return frozenset(given)
