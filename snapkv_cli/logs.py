"""snapkv logs: every question and answer, with its document, cache and timings, as `llm logs` keeps them."""

import datetime
import json

import typer

from snapkv.base.errors import ConfigError

from .usage import PlainCommand

app = typer.Typer(help="The log of questions and answers (a SQLite file; `snapkv logs path` says where).",
                  invoke_without_command=True, rich_markup_mode=None)


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


@app.callback()
def list_logs(
    ctx: typer.Context,
    count: int = typer.Option(10, "--count", "-n", min=1, help="How many of the latest answers."),
    search: str = typer.Option(None, "--search", "-s", help="Only answers whose question or answer holds this text."),
    as_json: bool = typer.Option(False, "--json", help="Print them as one JSON object."),
) -> None:
    """The latest answers, newest first."""
    if ctx.invoked_subcommand:
        return
    from snapkv.logbook import Logbook

    from .consoles import SCHEMA_VERSION, inert, stdout_console

    entries = Logbook().entries(count, search)
    if as_json:
        print(json.dumps({"schema_version": SCHEMA_VERSION,
                          "entries": [{k: v for k, v in e.items() if k != "report"} for e in entries]}))
        return
    console = stdout_console()
    if not entries:
        console.print("no answers logged yet" if not search else f"no logged answer holds {search!r}")
        return
    for entry in entries:
        sources = ", ".join(entry["sources"]) or "-"
        console.print(inert(f"#{entry['id']}  {_when(entry['created'])}  {entry['command']}  {entry['model']}  "
                            f"{sources} ({entry['document_tokens']} tokens, {entry['mode']}, "
                            f"{'cache hit' if entry['cache_hit'] else 'prefilled'})"), soft_wrap=True)
        console.print(inert(f"  Q: {entry['question']}"), soft_wrap=True)
        console.print(inert(f"  A: {entry['answer'].strip()}"), soft_wrap=True)


@app.command(cls=PlainCommand)
def show(
    entry_id: int = typer.Argument(..., metavar="ID", help="The number `snapkv logs` shows (#12 is 12)."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole entry, its command's report included."),
) -> None:
    """One logged answer, with its timings and where its cache is."""
    from snapkv.logbook import Logbook

    from .consoles import SCHEMA_VERSION, inert, stdout_console

    entry = Logbook().entry(entry_id)
    if entry is None:
        raise ConfigError(f"no logged answer #{entry_id}; `snapkv logs` lists them")
    if as_json:
        print(json.dumps({"schema_version": SCHEMA_VERSION, **entry}))
        return
    lines = [f"#{entry['id']}  {_when(entry['created'])}  snapkv {entry['command']}  {entry['model']}",
             f"document  {', '.join(entry['sources']) or '-'} ({entry['document_tokens']} tokens)",
             f"cache     {entry['cache_path'] or 'not saved'} ({'hit' if entry['cache_hit'] else 'prefilled'}, "
             f"{entry['mode']})",
             f"question  {entry['question']}",
             f"answer    {entry['answer'].strip()}",
             f"timings   first token {entry['ttft_seconds']:.2f} s, {entry['decode_tokens_per_second']:.1f} tokens/s, "
             f"{entry['new_tokens']} tokens ({entry['finish_reason']}), prefill {entry['prefill_seconds']:.2f} s"]
    stdout_console().print(inert("\n".join(lines)), soft_wrap=True)


@app.command(cls=PlainCommand)
def path() -> None:
    """Where the log is."""
    from snapkv.logbook import log_path

    print(log_path())
