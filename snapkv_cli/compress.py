"""snapkv compress: prefill a document, compress its cache, and save it to a file."""

from pathlib import Path

import typer

from snapkv.base.errors import CacheFileError, ConfigError
from snapkv.base.paths import CACHE_SUFFIX as SUFFIX

from .options import (DeviceMapOption, DeviceOption, DtypeOption, ModelOption, PasswordOption, SystemOption,
                      TruncateOption, settings_from, settings_options)


@settings_options()
def compress(
    source: str = typer.Argument(..., metavar="SOURCE", help="A document (.txt, .md, .pdf, .html), a folder of them, - for stdin, or "
                                           "a saved .snapkv file of a whole prompt in 16 bits to cut to a smaller "
                                           "tier without a new prefill."),
    output: Path = typer.Option(..., "--output", "-o", help=f"The cache file to write (ends in {SUFFIX})."),
    model: ModelOption = None,
    settings_given: dict = None,  # the settings options (snapkv_cli.options.settings_options)
    truncate: TruncateOption = None,
    device: DeviceOption = "auto",
    device_map: DeviceMapOption = None,
    dtype: DtypeOption = "auto",
    password: PasswordOption = None,
    system: SystemOption = None,
    as_json: bool = typer.Option(False, "--json", help="Print what was saved as one JSON object on stdout."),
) -> None:
    """Prefill SOURCE, compress its KV cache, and save it to --output for later questions.

    The same settings make the same cache as `snapkv ask SOURCE` does, so `snapkv ask FILE.snapkv` answers
    as `snapkv ask SOURCE` would.
    """
    from snapkv.storage.cachemeta import read_metadata
    from snapkv.io.documents import read_sources

    from .consoles import stderr_console, warn, working

    if output.suffix != SUFFIX:
        raise ConfigError(f"--output must end in {SUFFIX}, got {output}")
    if output.exists():
        try:
            read_metadata(output)
        except CacheFileError as error:
            raise ConfigError(f"{output} exists and is not a snapkv cache; refusing to overwrite it") from error
    settings = settings_from(**settings_given)
    err = stderr_console()
    from_file = source.endswith(SUFFIX)
    with working(err, "Reading documents..."):
        document = None if from_file else read_sources(source, password)
        if from_file:
            read_metadata(source)
    for note in document.notes if document is not None else []:
        warn(err, note)

    from snapkv.session import Session  # torch and the model code, once the input is known to be good

    from .render import load_with_status, prefill_progress, prepare_with_progress, scoring_label

    loaded, _ = load_with_status(err, model, device, dtype, device_map)
    session = Session(loaded, settings, truncate=truncate, system=system)
    if from_file:
        with working(err, "Loading saved cache..."):
            whole = session.load_file(source)
        if whole.tier.cut is not None or whole.tier.bits != 16:
            raise ConfigError(f"{source} holds {whole.tier.describe()}: only a file of the whole prompt in 16 bits "
                              "can be cut again without a prefill. Compress the document itself.")
        with prefill_progress(err, whole.tokens, scoring_label(settings)) as (_, on_step):
            prepared = session.derive(whole, on_step=on_step)
    else:
        prepared = prepare_with_progress(err, session, document)
    with working(err, "Saving..."):
        session.save(prepared, output)
    cache = prepared.cache
    full = cache.full_kv_bytes(2)
    if as_json:
        import json

        from .render import SCHEMA_VERSION

        print(json.dumps({
            "schema_version": SCHEMA_VERSION, "path": str(output), "file_bytes": prepared.file_bytes,
            "tokens": prepared.tokens, "mode": prepared.mode, "tier": prepared.tier.to_dict(),
            "per_question": prepared.per_question.to_dict() if prepared.per_question else None,
            "stored_tokens": cache.kept_tokens, "kept_per_question": prepared.kept_per_question,
            "stored_kv_bytes": cache.stored_kv_bytes, "full_kv_bytes_16bit": full,
            "prefill_seconds": round(prepared.prefill_seconds, 4), "tier_seconds": round(prepared.tier_seconds, 4),
            "save_seconds": round(prepared.save_seconds, 4)}))
        return
    err.print(f"{prepared.tokens} tokens, {prepared.mode}: {prepared.tier.describe()} saved "
              f"({cache.kept_tokens} positions per KV head per layer, KV {cache.stored_kv_bytes / 2**20:.1f} MiB, "
              f"{full / max(cache.stored_kv_bytes, 1):.1f}x less than the full cache's {full / 2**20:.1f} MiB in 16 "
              f"bits); each answer decodes against {prepared.kept_per_question} per head; "
              f"{'cut' if from_file else 'prefill'} {prepared.prefill_seconds:.2f} s", markup=False)
    err.print(f"saved {output} ({prepared.file_bytes / 2**20:.1f} MiB in {prepared.save_seconds:.2f} s)", markup=False)
