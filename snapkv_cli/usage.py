"""How every command draws its usage line and help: `snapkv ask [OPTIONS] SOURCE QUESTION...`, as man pages and
most tools write it, with plain value names (TEXT, N, NUMBER) instead of Python types."""

import re

from typer.core import TyperCommand

# Python type labels Typer shows after an option or argument, and the plain names shown instead
_PLAIN = {"str": "TEXT", "int": "N", "float": "NUMBER", "float range": "NUMBER", "int range": "N", "path": "PATH",
          "list[str]": "", "bool": ""}
_TYPE_LABEL = re.compile(r" <([a-z\[\] ]+)>")


def _plain_types(names: str) -> str:
    def plain(match: re.Match) -> str:
        shown = _PLAIN.get(match.group(1))
        if shown is None:  # a choice such as <max|avg> says more than a name would: kept
            return match.group(0)
        return f" {shown}" if shown else ""

    return _TYPE_LABEL.sub(plain, names)


class PlainCommand(TyperCommand):
    """A command whose usage line names its arguments plainly (optional ones in brackets, repeated ones with
    "...") and whose help shows value names instead of Python types."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name != "argument":
                continue
            name = (param.metavar or param.name.upper()) + ("..." if param.nargs != 1 else "")
            pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx, formatter) -> None:
        arguments, options = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            names, help_text = record
            names = _plain_types(names)
            if param.param_type_name == "argument":
                names = (param.metavar or param.name.upper()) + ("..." if param.nargs != 1 else "")
                arguments.append((names, help_text.replace("  [required]", "")))
            else:
                options.append((names, help_text))
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
