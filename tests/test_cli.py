"""The snapkv command as a user runs it: a real process, its exit code, stdout and stderr."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLE = Path(__file__).parent.parent / "samples" / "annual_report.txt"


def run_snapkv(*args: str, home: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "SNAPKV_HOME": str(home)}
    env.pop("SNAPKV_MODEL", None)
    return subprocess.run([sys.executable, "-m", "snapkv_cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL)  # nothing piped in


def test_help_explains_every_option(snapkv_home):
    result = run_snapkv("ask", "--help", home=snapkv_home)
    assert result.returncode == 0
    for option in ("--budget", "--window", "--kernel", "--pooling", "--query-aware", "--no-compress", "--json"):
        assert option in result.stdout


@pytest.mark.parametrize("args, code, message", [
    (["ask", str(SAMPLE), "q", "--budget", "16", "--window", "32"], 2, "budget (16) must be larger"),
    (["ask", str(SAMPLE), "q", "--budget", "-1"], 2, "budget"),
    (["ask", str(SAMPLE), "q", "--budget", "0"], 2, "budget"),
    (["ask", str(SAMPLE), "q", "--model", "nobody/no-such-model"], 3, "is not a model folder"),
    (["ask", str(SAMPLE.parent / "configs" / "nothing-here"), "q"], 4, "no such file or folder"),
    (["ask", str(SAMPLE), "q", "--kernel", "4"], 2, "kernel"),
    (["ask", "missing.txt", "q"], 4, "no such file"),
    (["ask", str(SAMPLE), "q", "--model", "missing.gguf"], 3, "no such GGUF file"),
    (["ask", str(SAMPLE), "q", "--device", "tpu:9"], 2, "device"),
    (["ask", str(SAMPLE)], 2, "Missing argument"),
    (["ask", "-c"], 2, "Missing a question: snapkv ask -c QUESTION"),
    (["serve", "--cite"], 2, "--cite goes with --http"),
    (["serve", "--http", "8123", "--store", "nosuch://bucket/caches"], 2, "is not a URL fsspec knows"),
])
def test_bad_input_gets_a_message_and_an_exit_code(snapkv_home, args, code, message):
    result = run_snapkv(*args, home=snapkv_home)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_ask_json_on_the_sample_report(embedded_home):
    result = run_snapkv("ask", str(SAMPLE.with_suffix(".pdf")), "What was the revenue for the 2023 financial year?",
                        "Where will the next annual general meeting be held?", "--json", "--budget", "512",
                        home=embedded_home)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    expected_keys = {
        "answers": {"question", "answer", "new_tokens", "ttft_seconds", "decode_tokens_per_second"},
        "document": {"tokens", "sources"},
        "compression": {"method", "budget", "window", "kernel", "pooling", "query_aware", "kept_tokens", "kv_bytes",
                        "kv_bytes_full"},
        "cache": {"path", "hit", "reused_tokens", "bytes", "load_seconds", "save_seconds"},
        "timings": {"model_load_seconds", "ingest_seconds", "prefill_seconds"},
        "memory": {"peak_bytes", "device"},
        "model": {"name", "context_length"},
    }
    for section, keys in expected_keys.items():
        for entry in report[section] if isinstance(report[section], list) else [report[section]]:
            assert keys <= set(entry), (section, keys - set(entry))
    assert report["document"]["sources"][0]["pages"] == 2
    assert [a["question"] for a in report["answers"]][0].startswith("What was the revenue")
    assert "184.6" in report["answers"][0]["answer"]
    assert "Wick" in report["answers"][1]["answer"]
    assert report["compression"]["method"] == "snapkv" and report["compression"]["budget"] == 512
    assert report["document"]["tokens"] > 512
    assert report["compression"]["kv_bytes_full"] >= report["compression"]["kv_bytes"] > 0
    # the figures name their precision: in memory in the compute dtype, the full cache as 16 bits hold it
    compression = report["compression"]
    element = {"float32": 4, "bfloat16": 2, "float16": 2}[compression["kv_dtype"]]
    assert compression["kv_bytes_full_16bit"] * element == compression["kv_bytes_full"] * 2
    assert report["timings"]["prefill_seconds"] > 0
    assert report["model"]["name"] == "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_second_ask_loads_the_saved_cache(embedded_home, tmp_path):
    home = tmp_path / "home"
    (home).mkdir()
    (home / "models").symlink_to(embedded_home / "models")
    question = "What was the revenue for the 2023 financial year?"
    first = run_snapkv("ask", str(SAMPLE), question, "--json", "--no-query-aware", "--budget", "512", home=home)
    assert first.returncode == 0, first.stderr
    first_report = json.loads(first.stdout)
    assert first_report["cache"]["hit"] is False and first_report["cache"]["bytes"] > 0
    saved = Path(first_report["cache"]["path"])
    assert saved.is_file() and saved.parent == home / "caches"
    second = run_snapkv("ask", str(SAMPLE), question, "--json", "--no-query-aware", "--budget", "512", home=home)
    second_report = json.loads(second.stdout)
    assert second_report["cache"]["hit"] is True and second_report["cache"]["path"] == str(saved)
    assert second_report["answers"][0]["answer"] == first_report["answers"][0]["answer"]
    direct = run_snapkv("ask", str(saved), question, "--json", home=home)
    assert direct.returncode == 0, direct.stderr
    assert json.loads(direct.stdout)["answers"][0]["answer"] == first_report["answers"][0]["answer"]
    saved.write_bytes(b"not a cache at all, just some bytes")
    broken = run_snapkv("ask", str(saved), question, home=home)
    assert broken.returncode == 5 and "not a snapkv cache" in broken.stderr and "Traceback" not in broken.stderr


@pytest.mark.slow
def test_a_document_piped_in_needs_no_source(embedded_home, tmp_path):
    """`cat report.txt | snapkv ask "Q"` reads the document from stdin, as `-` would; nothing piped, a question
    alone is a usage error."""
    env = {**os.environ, "SNAPKV_HOME": str(embedded_home), "SNAPKV_NOLOG": "1"}
    env.pop("SNAPKV_MODEL", None)
    with open(SAMPLE, "rb") as document:
        piped = subprocess.run([sys.executable, "-m", "snapkv_cli", "ask", "What was the 2023 revenue?", "-q",
                                "--no-store"], stdin=document, capture_output=True, text=True, env=env, timeout=600)
    assert piped.returncode == 0 and "184.6" in piped.stdout, piped.stderr
    alone = run_snapkv("ask", "What was the 2023 revenue?", home=tmp_path)
    assert alone.returncode == 2 and "Missing argument 'QUESTION'" in alone.stderr and "Traceback" not in alone.stderr
