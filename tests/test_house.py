"""The house rules a newcomer relies on: README stays a user's page, benchmarks/ stays a handful of scripts that each
compile and say what they measure."""

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_readme_is_a_page_for_users():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines: figures and provenance go to docs/measurements.md"


def test_benchmarks_are_a_handful_of_scripts_each_saying_what_it_measures():
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    assert 0 < len(scripts) < 12, [script.name for script in scripts]
    for script in scripts:
        tree = ast.parse(script.read_text(), filename=str(script))
        assert ast.get_docstring(tree), f"{script.name} has no docstring saying what it measures"
