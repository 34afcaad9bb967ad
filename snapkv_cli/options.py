"""The command-line options the commands share, and the settings they build. Defaults come from snapkv.config."""

from typing import Annotated, Literal, Optional

import typer

from snapkv.bits import Bits
from snapkv.config import DEFAULTS, SnapKVConfig
from snapkv.measured import measured_tiers
from snapkv.sizes import parse_size


def size(name: str, minimum: int = 1):
    """A parser for an option that takes a size: 7000, 8k, 1m (k = 1024)."""
    return lambda value: value if isinstance(value, int) else parse_size(value, name=name, minimum=minimum)


MaxTokensOption = Annotated[int, typer.Option(parser=size("--max-new-tokens"), metavar="SIZE",
                                              help="Longest answer, in tokens.")]
ModelOption = Annotated[Optional[str], typer.Option(
    "--model", "-m", envvar="SNAPKV_MODEL",
    help="Hugging Face id (local cache only), model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct.")]
BudgetOption = Annotated[int, typer.Option(
    parser=size("--budget"), metavar="SIZE",
    help="Positions kept per KV head per layer for each answer, the observation window included (1k = 1024). "
         "A document up to the budget is answered from all of it. The default, 4096, was chosen by `snapkv eval "
         "fidelity` against the full cache: answers to 443 questions were 84% identical and lost 1 of 107 facts "
         "found (on the documents alone, 1024 gave 35% identical and 18 lost, 2048 58% and 6; README, Defaults).")]
WindowOption = Annotated[int, typer.Option(
    parser=size("--window"), metavar="SIZE", help="Observation window: how many final positions decide what is kept.")]
KernelOption = Annotated[int, typer.Option(help="Width of the pooling over attention scores (odd); wider keeps whole numbers and names.")]
PoolingOption = Annotated[Literal["max", "avg"], typer.Option(help="Pooling of the scores.")]
QueryAwareOption = Annotated[bool, typer.Option(
    "--query-aware/--no-query-aware",
    help="Query-aware: save a stored tier of the document (--store-keep, --store-method, --store-bits) and cut it "
         "to --budget per question, with the question as the window. Otherwise compress once at prefill to "
         "--budget with the document's tail as the window (smallest file; finds fewer facts).")]
NoCompressOption = Annotated[bool, typer.Option("--no-compress", help="Keep the full cache (the baseline).")]
StoreBudgetOption = Annotated[Optional[int], typer.Option(
    parser=size("--store-budget"), metavar="SIZE",
    help="Query-aware: the saved tier as positions per head instead of a share (--store-keep); each question "
         "is then cut from that tier.")]
StoreKeepOption = Annotated[Optional[float], typer.Option(
    min=0.0, max=1.0,
    help="Query-aware: the share of the document's positions the saved file keeps, chosen by --store-method "
         "(the template around the document is always kept). Default: the whole prompt. 0.7 at 4 bits is 4.5x "
         "smaller than the full cache but missed 2-3 more of 44 needles and 2 of 10 facts; 0.5 at 4 bits 6.3x "
         "(README, What is saved).")]
StoreMethodOption = Annotated[Literal["reconstruction", "snapkv", "pseudo-question", "key-norm"], typer.Option(
    help="How the saved tier is chosen: pseudo-question (a generic question and the document's tail re-read "
         "as windows; the most accurate measured), reconstruction (the positions the model needs to repeat the "
         "document, KVzip's idea; one more pass over the document), snapkv (the document's tail as the window) "
         "or key-norm (the smallest keys; no extra pass).")]
def _bits(value):
    """A parser for --store-bits: 8, KEYS/VALUES as 4/3, or REST+SHARE%@SHARP as 3/2+20%@8/4."""
    try:
        return Bits.parse(value)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


StoreBitsOption = Annotated[Bits, typer.Option(
    parser=_bits, metavar="BITS",
    help=f"Bits per saved key and value: 16 (lossless in bf16), 8, 4, 3 or 2, keys and values apart as "
         f"KEYS/VALUES (16/4: keys in 16 bits, values in 4), or a sharper share as REST+SHARE%@SHARP (3/2+20%@8/4: "
         f"each head's 20% of positions that a generic question and the document's tail attend to most in 8/4 "
         f"bits, the rest in 3/2). Default {DEFAULTS.store_bits}: the smallest tier that `snapkv eval fidelity` "
         f"measured to lose no fact the 16-bit file answers and to change a number or name in at most 1% of "
         f"answers. Measured against the 16-bit file, every question cut to the default budget (answers identical "
         f"to the 16-bit file's, answers with a number or name changed, facts lost): {measured_tiers()}. Below 8 "
         f"bits each head's vectors are Hadamard-rotated before rounding. Computation stays in the model's dtype.")]
PrefillChunkOption = Annotated[Optional[int], typer.Option(
    parser=size("--prefill-chunk"), metavar="SIZE",
    help="Prefill a longer prompt in chunks of SIZE tokens, cutting every layer back with SnapKV after each: "
         "memory bounded by the budget plus one chunk, time linear in length (for prompts whose exact prefill "
         "is too slow or too large). The saved tier is then SnapKV's (--budget, or --store-budget, default 4x "
         "the budget, in query-aware mode); it finds fewer facts than the exact prefill (README).")]
CompileOption = Annotated[bool, typer.Option(
    "--compile/--no-compile",
    help="Decode with a compiled step (torch.compile over a static cache; needs a C compiler on CPU). Off by "
         "default: on a 2-core CPU in bf16 it decoded SnapKV 1.2x faster (32.9 against 40.4 ms/token at 7k) "
         "but compiled for 44 s the first time (5 s from the cache), so it pays back only after about 6,000 "
         "tokens (700 from the cache), and its bf16 rounding changed a greedy answer (README, Measured). "
         "Compiled code is cached in the snapkv home; a failed compile falls back to the eager step.")]
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
SETTING_OPTIONS = ("budget", "window", "kernel", "pooling", "query_aware", "no_compress", "store_budget",
                   "store_keep", "store_method", "store_bits", "prefill_chunk")
STORE_OPTIONS = ("store_budget", "store_keep", "store_method", "store_bits")


def settings_from(budget: int = DEFAULTS.budget, window: int = DEFAULTS.window, kernel: int = DEFAULTS.kernel,
                  pooling: str = DEFAULTS.pooling, query_aware: bool = DEFAULTS.query_aware,
                  no_compress: bool = False, store_budget: int | None = None,
                  store_keep: float | None = DEFAULTS.store_keep, store_method: str = DEFAULTS.store_method,
                  store_bits: Bits = DEFAULTS.store_bits,
                  prefill_chunk: int | None = None) -> SnapKVConfig | None:
    """The settings a command line asks for; None for --no-compress (the full cache)."""
    if no_compress:
        return None
    if store_budget is not None:
        store_keep = None  # positions per head instead of the default share
    return SnapKVConfig(budget=budget, window=window, kernel=kernel, pooling=pooling, query_aware=query_aware,
                        store_budget=store_budget, store_keep=store_keep, store_method=store_method,
                        store_bits=store_bits, prefill_chunk=prefill_chunk)


def explicit_settings(ctx: typer.Context) -> frozenset[str]:
    """The settings options given on the command line (not left at their defaults)."""
    given = set()
    for name in SETTING_OPTIONS:
        source = ctx.get_parameter_source(name)  # None for an option the command does not have
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            given.add(name)
    return frozenset(given)
