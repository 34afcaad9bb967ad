"""snapkv compress: prefill a document, compress its cache, and save it to a file."""

from pathlib import Path
from typing import Optional

import typer

from snapkv.config import SnapKVConfig
from snapkv.documents import read_sources
from snapkv.errors import CacheFileError, ConfigError
from snapkv.session import Session
from snapkv.store import SUFFIX, read_metadata

from .common import (BudgetOption, DeviceMapOption, DeviceOption, DtypeOption, KernelOption, ModelOption, PasswordOption,
                     PoolingOption, TruncateOption, WindowOption, load_with_status, prepare_with_progress,
                     stderr_console)


def compress(
    source: str = typer.Argument(..., help="A document (.txt, .md, .pdf, .html), a folder of them, or - for stdin."),
    output: Path = typer.Option(..., "--output", "-o", help=f"The cache file to write (ends in {SUFFIX})."),
    model: ModelOption = None,
    budget: BudgetOption = 1024,
    window: WindowOption = 32,
    kernel: KernelOption = 15,
    pooling: PoolingOption = "max",
    query_aware: bool = typer.Option(
        False, "--query-aware/--no-query-aware",
        help="Save a tier for query-aware answering (the whole cache, or --store-budget) instead of the "
             "cache compressed to --budget with the document's tail as the window."),
    store_budget: Optional[int] = typer.Option(None, help="With --query-aware: positions kept in the saved tier."),
    truncate: TruncateOption = None,
    device: DeviceOption = "auto",
    device_map: DeviceMapOption = None,
    dtype: DtypeOption = "auto",
    password: PasswordOption = None,
) -> None:
    """Prefill SOURCE, compress its KV cache with SnapKV, and save it to --output for later questions."""
    if output.suffix != SUFFIX:
        raise ConfigError(f"--output must end in {SUFFIX}, got {output}")
    if output.exists():
        try:
            read_metadata(output)
        except CacheFileError as error:
            raise ConfigError(f"{output} exists and is not a snapkv cache; refusing to overwrite it") from error
    settings = SnapKVConfig(budget=budget, window=window, kernel=kernel, pooling=pooling,
                            query_aware=query_aware, store_budget=store_budget)
    err = stderr_console()
    with err.status("Reading documents..."):
        document = read_sources(source, password)
    loaded, _ = load_with_status(err, model, device, dtype, device_map)
    session = Session(loaded, settings, truncate=truncate)
    prepared = prepare_with_progress(err, session, document)
    with err.status("Saving..."):
        session.save(prepared, output)
    cache = prepared.cache
    kept = cache.kept_tokens
    err.print(f"{prepared.tokens} tokens -> {kept} kept per KV head per layer "
              f"({prepared.tokens / kept:.1f}x fewer), KV {cache.kv_bytes / 2**20:.1f} MiB of "
              f"{cache.full_kv_bytes() / 2**20:.1f} MiB; prefill {prepared.prefill_seconds:.2f} s", markup=False)
    err.print(f"saved {output} ({prepared.file_bytes / 2**20:.1f} MiB in {prepared.save_seconds:.2f} s)", markup=False)
