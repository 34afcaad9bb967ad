"""snapkv pull: a GGUF file fetched into the snapkv home (the one command that uses the network, and only when run)."""

from typing import Optional

import typer


def pull(
    source: str = typer.Argument(..., help="A URL of a .gguf file, or a Hugging Face repository id (owner/name) "
                                           "with --file."),
    file: Optional[str] = typer.Option(None, help="With a Hugging Face repository id: the .gguf file in it "
                                                  "(Qwen2.5-7B-Instruct-Q4_K_M.gguf, say)."),
    name: Optional[str] = typer.Option(None, help="The name to keep it under (default: the file's, less .gguf); "
                                                  "pass it to --model."),
    sha256: Optional[str] = typer.Option(None, help="The file's sha256: checked before the file is kept (a Hugging "
                                                    "Face file's published one is checked without it)."),
) -> None:
    """Fetch a GGUF model file into the snapkv home, then use it by name: `snapkv ask -m NAME ...`.

    An interrupted pull goes on where it stopped when run again. The whole file's sha256 (where known) and its GGUF
    header are checked before it is kept; a file that fails either is deleted. snapkv reads the file in its own
    blocks (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0 files): memory is about the file's size.
    """
    from snapkv.engine.pull import pull as fetch
    from snapkv.engine.pull import resolve

    from .consoles import stdout_console
    from .render import stderr_console

    chosen = resolve(source, file, name, sha256)
    err = stderr_console()
    shown = {"step": -1}

    def progress(done: int, total: int | None) -> None:
        step = done * 20 // total if total else done // (100 * 2**20)
        if step != shown["step"]:
            shown["step"] = step
            of = f" of {total / 2**20:,.0f} MiB" if total else ""
            err.print(f"snapkv: {chosen.name}: {done / 2**20:,.0f} MiB{of}", markup=False, highlight=False)

    path = fetch(chosen, progress)
    checked = "sha256 checked, " if chosen.sha256 else "no sha256 to check (pass --sha256), "
    err.print(f"snapkv: {chosen.name}: {checked}GGUF header read", markup=False, highlight=False)
    stdout_console().print(f"{path}\nuse it with: snapkv ask -m {chosen.name} DOCUMENT QUESTION", markup=False,
                           highlight=False)
