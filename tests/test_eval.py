"""snapkv eval: the needle grid and many questions on one saved cache, on a small grid."""

import json

import pytest
from typer.testing import CliRunner

from snapkv.measure.evaluation import multi_fact_document
from snapkv.io.haystack import filler_text
from snapkv_cli.app import app


def test_multi_fact_document_holds_every_fact(embedded):
    text, facts = multi_fact_document(embedded.tokenizer, filler_text(), 1500, 5)
    assert len({fact.number for fact in facts}) == 5
    positions = [text.index(fact.sentence) for fact in facts]
    assert positions == sorted(positions)  # spread through the document in order


@pytest.mark.slow
def test_needle_grid_json_and_heatmaps(home, tmp_path):
    result = CliRunner().invoke(app, ["eval", "needle", "--lengths", "600", "--depths", "20,80", "--budgets", "256",
                                      "--json", "--plot-dir", str(tmp_path / "maps")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["found"]) == {"full", "query-aware 256", "document-window 256"}
    assert data["lengths"] == [600] and data["depths"] == [0.2, 0.8]
    assert data["accuracy"]["full"] == 1.0  # the embedded model finds a needle in 600 tokens
    assert data["accuracy"]["query-aware 256"] == 1.0
    assert sorted(p.name for p in (tmp_path / "maps").iterdir()) == [
        "needle-document-window-256.png", "needle-full.png", "needle-query-aware-256.png"]


@pytest.mark.slow
def test_many_questions_from_one_saved_cache(home):
    result = CliRunner().invoke(app, ["eval", "multi", "--tokens", "1200", "--facts", "3", "--budgets", "512",
                                      "--modes", "query-aware", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["found"]) == {"full", "query-aware 512"}
    assert all(len(found) == 3 for found in data["found"].values())
    # at most one fact fewer than the full cache (counted, not compared as floats: 2/3 < 1 - 1/3 in floats)
    assert sum(data["found"]["query-aware 512"]) >= sum(data["found"]["full"]) - 1
    assert data["file_bytes"]["full"] > 0


def test_bad_eval_options(home):
    from snapkv.base.errors import ConfigError

    unknown = CliRunner().invoke(app, ["eval", "multi", "--modes", "psychic"])
    assert unknown.exit_code == 2  # a usage error, listing the modes there are
    assert "psychic" in unknown.output and "query-aware" in unknown.output and "document-window" in unknown.output
    with pytest.raises(ConfigError, match="depths"):
        CliRunner().invoke(app, ["eval", "needle", "--depths", "150"], catch_exceptions=False)
