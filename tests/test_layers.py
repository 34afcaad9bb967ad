"""The library's layers, bottom to top: a module imports only from its own layer and those below it (function-level
imports included), and never from the CLI. A new module goes in the lowest layer its imports allow."""

import ast
from pathlib import Path

LIBRARY = Path(__file__).parent.parent / "snapkv"
# snapkv/<layer>/...; "front door" is snapkv/*.py (session, answering, logbook); measure drives the front door
LAYERS = ("base", "native", "io", "modeling", "compression", "storage", "engine", "citing", "front door", "measure", "serving")


def layer_of(module: str) -> str:
    """'snapkv.storage.cachefile' -> 'storage'; 'snapkv.session' -> 'front door'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "front door"


def module_name(path: Path, library: Path) -> str:
    parts = list(path.relative_to(library.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, library: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every snapkv or snapkv_cli import in the file, wherever it is in the file."""
    name = module_name(path, library)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if node.module is None or base == "snapkv":  # from snapkv import a, b: the modules a and b
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "__version__"]
            else:
                found.append((node.lineno, base))
    return [(line, module) for line, module in found if module.split(".")[0] in ("snapkv", "snapkv_cli")]


def imports_against_the_layers(library: Path) -> list[str]:
    wrong = []
    for path in sorted(library.rglob("*.py")):
        source = module_name(path, library)
        for line, target in imported_modules(path, library):
            where = f"{path.relative_to(library.parent)}:{line}"
            if target.startswith("snapkv_cli"):
                wrong.append(f"{where} imports the CLI ({target})")
            elif LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(source)):
                wrong.append(f"{where} ({layer_of(source)}) imports {target} ({layer_of(target)})")
    return wrong


def test_the_layers_are_the_folders():
    folders = {p.name for p in LIBRARY.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == set(LAYERS) - {"front door"}


def test_every_import_points_down_or_across():
    wrong = imports_against_the_layers(LIBRARY)
    assert not wrong, "\n".join(wrong)


def test_an_import_that_points_up_is_found(tmp_path):
    library = tmp_path / "snapkv"
    (library / "base").mkdir(parents=True)
    (library / "base" / "probe.py").write_text("def f():\n    from ..engine.models import load_model\n    from snapkv.base import errors\n")
    (library / "session.py").write_text("import snapkv_cli.app\nfrom snapkv.engine.models import load_model\n")
    assert imports_against_the_layers(library) == [
        "snapkv/base/probe.py:2 (base) imports snapkv.engine.models (engine)",
        "snapkv/session.py:1 imports the CLI (snapkv_cli.app)"]


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports (anywhere in the file), each import named by its module."""
    graph = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            graph[module_name(path, root / package)] = {target for _, target in imported_modules(path, root / package)}
    known = set(graph)

    def module_of(target: str) -> str | None:  # 'snapkv.base.errors.ConfigError' -> 'snapkv.base.errors'
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    return {module: {found for target in targets if (found := module_of(target)) not in (None, module)}
            for module, targets in graph.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import one another in a circle (the graph's strongly connected components of more
    than one module), each sorted."""
    order, lowest, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(module: str) -> None:  # Tarjan's algorithm
        order[module] = lowest[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                lowest[module] = min(lowest[module], lowest[target])
            elif target in on_stack:
                lowest[module] = min(lowest[module], order[target])
        if lowest[module] == order[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return circles


def test_no_module_imports_itself_through_others():
    assert import_circles(import_graph(LIBRARY.parent, ("snapkv", "snapkv_cli"))) == []


def test_a_circle_of_imports_is_found(tmp_path):
    cli = tmp_path / "snapkv_cli"
    cli.mkdir()
    (cli / "app.py").write_text("from . import ask\n")
    (cli / "ask.py").write_text("def f():\n    from .serve import g\n")
    (cli / "serve.py").write_text("def g():\n    from .app import run\n")
    (cli / "info.py").write_text("from .ask import f\n")
    assert import_circles(import_graph(tmp_path, ("snapkv_cli",))) == [
        ["snapkv_cli.app", "snapkv_cli.ask", "snapkv_cli.serve"]]
