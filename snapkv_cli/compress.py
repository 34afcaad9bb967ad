"""snapkv compress: prefill a document, compress its cache, and save it to a file."""

from pathlib import Path

import typer

from snapkv.cachefile import SUFFIX, read_metadata
from snapkv.config import DEFAULTS
from snapkv.documents import read_sources
from snapkv.errors import CacheFileError, ConfigError
from snapkv.session import Session

from .options import (BudgetOption, DeviceMapOption, DeviceOption, DtypeOption, KernelOption, ModelOption,
                      NoCompressOption, PasswordOption, PoolingOption, QueryAwareOption, StoreBudgetOption,
                      TruncateOption, WindowOption, settings_from)
from .render import load_with_status, prepare_with_progress, stderr_console


def compress(
    source: str = typer.Argument(..., help="A document (.txt, .md, .pdf, .html), a folder of them, or - for stdin."),
    output: Path = typer.Option(..., "--output", "-o", help=f"The cache file to write (ends in {SUFFIX})."),
    model: ModelOption = None,
    budget: BudgetOption = DEFAULTS.budget,
    window: WindowOption = DEFAULTS.window,
    kernel: KernelOption = DEFAULTS.kernel,
    pooling: PoolingOption = DEFAULTS.pooling,
    query_aware: QueryAwareOption = DEFAULTS.query_aware,
    store_budget: StoreBudgetOption = DEFAULTS.store_budget,
    no_compress: NoCompressOption = False,
    truncate: TruncateOption = None,
    device: DeviceOption = "auto",
    device_map: DeviceMapOption = None,
    dtype: DtypeOption = "auto",
    password: PasswordOption = None,
) -> None:
    """Prefill SOURCE, compress its KV cache, and save it to --output for later questions.

    The same settings make the same cache as `snapkv ask SOURCE` does, so `snapkv ask FILE.snapkv` answers
    as `snapkv ask SOURCE` would.
    """
    if output.suffix != SUFFIX:
        raise ConfigError(f"--output must end in {SUFFIX}, got {output}")
    if output.exists():
        try:
            read_metadata(output)
        except CacheFileError as error:
            raise ConfigError(f"{output} exists and is not a snapkv cache; refusing to overwrite it") from error
    settings = settings_from(budget, window, kernel, pooling, query_aware, no_compress, store_budget)
    err = stderr_console()
    with err.status("Reading documents..."):
        document = read_sources(source, password)
    loaded, _ = load_with_status(err, model, device, dtype, device_map)
    session = Session(loaded, settings, truncate=truncate)
    prepared = prepare_with_progress(err, session, document)
    with err.status("Saving..."):
        session.save(prepared, output)
    cache = prepared.cache
    err.print(f"{prepared.tokens} tokens, {prepared.mode}: {prepared.tier.describe()} saved "
              f"({cache.kept_tokens} positions per KV head per layer, KV {cache.kv_bytes / 2**20:.1f} MiB of "
              f"{cache.full_kv_bytes() / 2**20:.1f} MiB); each answer decodes against {prepared.kept_per_question} "
              f"per head; prefill {prepared.prefill_seconds:.2f} s", markup=False)
    err.print(f"saved {output} ({prepared.file_bytes / 2**20:.1f} MiB in {prepared.save_seconds:.2f} s)", markup=False)
