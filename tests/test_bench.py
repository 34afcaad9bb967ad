"""snapkv bench: lengths, refusals, the JSON rows, the plot, random-weights shapes."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from snapkv.base.errors import ConfigError, OutOfMemoryError
from snapkv.base.sizes import parse_size, parse_sizes
from snapkv_cli.app import app

TINY_SHAPE = Path(__file__).parent.parent / "samples" / "configs" / "tiny-llama.json"


def test_parse_size():
    assert parse_size("8k") == 8192 and parse_size("128K") == 131072
    assert parse_size("1m") == 1048576 and parse_size("7000") == 7000 and parse_size("1.5k") == 1536
    assert parse_sizes("1k, 2k,7000") == [1024, 2048, 7000]
    for bad in ("", "k", "lots", "4"):
        with pytest.raises(ConfigError, match="--length"):
            parse_size(bad, name="--length", minimum=16)
    with pytest.raises(ConfigError, match="at least one"):
        parse_sizes(" , ", name="--budget")


def test_random_weights_bench_json_and_plot(home, tmp_path):
    plot = tmp_path / "bench.png"
    result = CliRunner().invoke(app, ["bench", "--random-weights", str(TINY_SHAPE), "--length", "600,1200",
                                      "--budget", "128,256", "--decode-tokens", "4", "--json", "--plot", str(plot)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = data["rows"]
    assert [(r["length"], r["method"], r["budget"]) for r in rows] == [
        (600, "full", None), (600, "snapkv", 128), (600, "snapkv", 256),
        (1200, "full", None), (1200, "snapkv", 128), (1200, "snapkv", 256)]
    for row in rows:
        assert row["needle_found"] is None  # random weights: not meaningful
        assert row["prefill_seconds"] > 0 and row["decode_ms_per_token"] > 0
        # a prefill's peak holds at least the cache it leaves behind; an answer allocates something too
        assert row["peak_memory_bytes"] >= row["kv_bytes"] > 0 and row["answer_peak_memory_bytes"] > 0
    full, small = rows[3], rows[4]
    assert small["kv_bytes"] < full["kv_bytes"]
    # the floor: the weights and the KV decoded against, read once per token at the bandwidth measured
    assert data["read_bandwidth"] > 1e8 and data["weight_bytes"] > 0
    for row in rows:
        assert row["bytes_per_token"] == data["weight_bytes"] + row["kv_bytes"]
        expected_floor = 1000 * row["bytes_per_token"] / data["read_bandwidth"]
        assert row["floor_ms_per_token"] == pytest.approx(expected_floor)
        assert row["above_floor"] == pytest.approx(row["decode_ms_per_token"] / expected_floor)
    assert full["floor_ms_per_token"] > small["floor_ms_per_token"]
    # the query-aware tiers are made from the full row's prefill, the same forward pass, timed once
    assert [row["prefill_shared"] for row in rows] == [False, True, True] * 2
    assert all(row["prefill_seconds"] > rows[3 * (i // 3)]["prefill_seconds"] for i, row in enumerate(rows) if i % 3)
    follow = data["followup"]
    assert follow["length"] == 1200 and follow["speedup"] > 0
    # the round of median total is the one reported
    assert len(follow["round_seconds"]) == 3
    assert follow["load_seconds"] + follow["ttft_seconds"] == pytest.approx(sorted(follow["round_seconds"])[1])
    assert any("random weights" in note for note in data["notes"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lengths_past_the_context_are_refused(home):
    with pytest.raises(ConfigError, match="--allow-extrapolation"):
        CliRunner().invoke(app, ["bench", "--length", "128k"], catch_exceptions=False)


def test_too_large_a_shape_is_refused_before_allocating(home):
    shape = Path(__file__).parent.parent / "samples" / "configs" / "llama-3.1-8b.json"
    with pytest.raises(OutOfMemoryError, match="GiB"):
        CliRunner().invoke(app, ["bench", "--random-weights", str(shape), "--dtype", "float32", "--device", "cpu"],
                           catch_exceptions=False)


MEASURE_TWICE = """
import torch
from snapkv.engine.memory import PeakMemory
for _ in range(2):
    with PeakMemory(torch.device("cpu"), release=True) as memory:
        blocks = [torch.ones(256 * 1024) for _ in range(300)]  # 300 blocks of 1 MiB
    del blocks
    print(memory.peak / 2**20)
"""


def test_peak_memory_sees_each_block_in_one_process():
    """Two equal allocations measured one after the other in one fresh process both read their full size:
    memory freed by the first is handed back before the second is measured. (A fresh process, because RSS
    growth inside the test process also moves with what earlier tests left behind.)"""
    import subprocess
    import sys

    output = subprocess.run([sys.executable, "-c", MEASURE_TWICE], capture_output=True, text=True, check=True)
    peaks = [float(line) for line in output.stdout.split()]
    assert len(peaks) == 2 and all(peak >= 0.9 * 300 for peak in peaks), peaks


def test_weight_bytes_per_token_counts_a_shared_table_once_and_a_separate_one_as_a_row():
    from conftest import build_tiny
    from snapkv.measure.floor import weight_bytes_per_token

    model = build_tiny("llama-gqa")  # untied: the input table is read one row per token, the head whole
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.get_input_embeddings().weight
    assert weight_bytes_per_token(model) == every - table.numel() * 4 + table.shape[1] * 4
    model.get_output_embeddings().weight = table  # tied: the table is read whole, once
    assert weight_bytes_per_token(model) == every - table.numel() * 4


def test_a_length_too_long_for_the_exact_prefill_gets_snapkv_in_chunks_and_the_full_cache_estimated(home):
    result = CliRunner().invoke(app, ["bench", "--random-weights", str(TINY_SHAPE), "--length", "600,1200",
                                      "--budget", "128", "--decode-tokens", "4", "--repeats", "1",
                                      "--max-prefill-seconds", "0", "--prefill-chunk", "256", "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = data["rows"]
    assert [(r["length"], r["method"], r["estimated"], r["prefill_chunk"]) for r in rows] == [
        (600, "full", True, None), (600, "snapkv", False, 256), (1200, "full", True, None), (1200, "snapkv", False, 256)]
    for estimate in rows[0], rows[2]:  # the JSON rows keep their keys; an estimate says so
        assert estimate["prefill_seconds"] == estimate["exact_estimate_seconds"] > 0
        assert estimate["decode_ms_per_token"] == 0
    assert rows[2]["prefill_seconds"] > 2 * rows[0]["prefill_seconds"]  # an exact prefill grows faster than n
    assert rows[1]["kv_bytes"] == rows[3]["kv_bytes"] > 0  # bounded: the same cache at both lengths
    assert set(data["growth"]["snapkv 128 in chunks of 256"]) == {"prefill_seconds", "decode_ms_per_token",
                                                                   "peak_memory_bytes"}
    assert data["followup"] is None and sum("in chunks of 256" in note for note in data["notes"]) == 2
    progress = [line for line in result.stderr.splitlines() if "Prefilling" in line]  # off a terminal: lines
    for length in (600, 1200):
        said = [line for line in progress if f"Prefilling {length} tokens, SnapKV at 128 in chunks of 256" in line]
        assert len(said) >= 3 and said[-1].startswith("snapkv: ") and "100% done (" in said[-1], progress


def test_a_tier_made_after_the_prefill_takes_the_full_rows_prefill_and_is_the_cache_its_own_would_make(home):
    """The query-aware tiers (the whole prompt in 8 bits, a share chosen by probes) start from the forward pass the
    full cache's row ran: the bench times it once and makes each tier from it, the same cache, bit for bit, as that
    tier's own prefill gives; a cut during the prefill is prefilled."""
    from dataclasses import replace

    import torch

    from snapkv.compression.config import DEFAULTS
    from snapkv.engine.models import random_weights_model
    from snapkv.io.documents import Document
    from snapkv.io.haystack import build_haystack, filler_text
    from snapkv.measure.bench import NEEDLE_NUMBER, _prepare
    from snapkv.session import Session

    loaded = random_weights_model(str(TINY_SHAPE))
    document = Document(build_haystack(loaded.tokenizer, filler_text(), 600, 0.5, NEEDLE_NUMBER).text)
    said = []
    whole, shared = _prepare(Session(loaded, None, allow_extrapolation=True), document, 600, None, said.append)
    assert not shared and whole.prefill_seconds > 0 and "Prefilling 600 tokens, full cache" in said[0]
    for settings, from_full in ((replace(DEFAULTS, budget=128), True),
                                (replace(DEFAULTS, budget=128, store_keep=0.5, store_bits="16/8"), True),
                                (replace(DEFAULTS, budget=128, query_aware=False), False)):
        session = Session(loaded, settings, allow_extrapolation=True)
        made, shared = _prepare(session, document, 600, whole, said.append)
        own = session.prepare(session.prompt(document, max_tokens=600))
        assert shared is from_full and made.tier == own.tier and made.per_question == own.per_question
        assert made.cache.kept_tokens == own.cache.kept_tokens
        for mine, theirs in ((made.cache.keys, own.cache.keys), (made.cache.values, own.cache.values),
                             (made.cache.positions, own.cache.positions)):
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
        if shared:  # the full row's prefill (with its rounding to 16 bits) counted, then its own tier
            assert made.prefill_seconds - made.tier_seconds == pytest.approx(whole.prefill_seconds
                                                                             - whole.tier_seconds)
            assert made.tier_seconds > whole.tier_seconds
            assert made.prefill_peak_bytes >= whole.prefill_peak_bytes and "the same forward pass" in said[-1]


def test_fit_growth_recovers_the_exponent():
    from snapkv.measure.bench import BenchRow, fit_growth

    rows = [BenchRow(n, "snapkv", 128, True, 0.001 * n ** 2, 0.1, 5.0 * n, 10, 7 * n, None) for n in (1000, 2000, 8000)]
    rows.append(BenchRow(16000, "full", None, False, 9.0, 0, 0, 0, 0, None, estimated=True))
    growth = fit_growth(rows)
    assert set(growth) == {"snapkv 128"}  # an estimate is not a measurement
    assert growth["snapkv 128"]["prefill_seconds"] == pytest.approx(2.0)
    assert growth["snapkv 128"]["decode_ms_per_token"] == pytest.approx(1.0)
    assert growth["snapkv 128"]["peak_memory_bytes"] == pytest.approx(1.0)


def test_random_gguf_blocks_are_read_as_a_files_blocks_and_bad_choices_refused(home):
    result = CliRunner().invoke(app, ["bench", "--random-weights", str(TINY_SHAPE), "--weight-blocks", "Q8_0",
                                      "--length", "600", "--budget", "128", "--decode-tokens", "4", "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert "random Q8_0 blocks" in data["model"]
    # every matrix in Q8_0 (34 bytes a block of 32): 4 layers of q, k, v, o, gate, up, down, and the head; one
    # row of the embeddings; norms in fp32
    hidden, inner, kv, layers, vocab = 128, 256, 2 * 16, 4, 49152
    matrices = layers * (hidden * (2 * hidden + 2 * kv) + 3 * hidden * inner) + vocab * hidden
    norms = 4 * ((2 * layers + 1) * hidden)
    assert data["weight_bytes"] == matrices // 32 * 34 + hidden // 32 * 34 + norms
    assert all(row["engine"]["steps"] == "native" for row in data["rows"])
    refused = CliRunner().invoke(app, ["bench", "--weight-blocks", "Q8_0"])
    assert refused.exit_code == 2 and "--random-weights" in refused.output
    with pytest.raises(ConfigError, match="whole blocks"):  # 128 inputs are not whole blocks of 256
        CliRunner().invoke(app, ["bench", "--random-weights", str(TINY_SHAPE), "--weight-blocks", "Q4_K"],
                           catch_exceptions=False)
    with pytest.raises(ConfigError, match="use one of"):
        CliRunner().invoke(app, ["bench", "--random-weights", str(TINY_SHAPE), "--weight-blocks", "IQ2_XS"],
                           catch_exceptions=False)
