"""Every engine (snapkv.engine.engines) against the model's own forward: greedy tokens equal on the tiny architectures and on
the embedded model, with each C kernels' variant this CPU runs; which engine ran is reported."""

import json

import pytest

from snapkv import native
from snapkv.base.bits import Bits
from snapkv.compression.config import ENGINE_CHOICES, Cut, SnapKVConfig
from snapkv.engine.engines import EngineUse, engine_order
from snapkv.base.errors import ConfigError
from snapkv.engine.generation import answer, prefill

from conftest import TINY_CONFIGS, build_tiny
from test_coded_attention import saved
from test_native_decode import ids, on_blocks

PROMPT = 203
QUESTION = 9
has_kernels = native.unavailable_reason() is None


def answers(model, cache, engine: str, per_question: Cut | None, tokens: int = 16) -> tuple[list[int], EngineUse]:
    used = EngineUse()
    found = list(answer(model, cache, ids(QUESTION, 2), per_question=per_question, max_new_tokens=tokens,
                        engine=engine, used=used))
    return found, used


def test_the_orders_start_where_the_setting_says():
    assert [engine.name for engine in engine_order("auto")] == ["native", "torch", "reference"]
    assert [engine.name for engine in engine_order("compiled")] == ["compiled", "native", "torch", "reference"]
    assert [engine.name for engine in engine_order("reference")] == ["reference"]
    with pytest.raises(ConfigError, match="one of auto, native, torch, compiled, reference"):
        engine_order("fastest")


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("per_question", [None, Cut(64, 8)])
def test_every_engine_answers_as_the_model_forward_on_every_tiny_architecture(name, per_question):
    """Plain fp32 weights: the torch engine where the architecture is plain Llama-family, the model's forward
    elsewhere; every setting gives the reference's tokens and says what ran."""
    model = build_tiny(name)
    cache = prefill(model, ids(PROMPT, 1), None)
    expected, used = answers(model, cache, "reference", per_question)
    assert len(set(expected)) > 2 and used.question == used.steps == "reference"  # says something
    for engine in ENGINE_CHOICES:
        if engine == "compiled":
            continue  # compiling takes seconds per architecture: test_engine.py's compiled tests
        found, used = answers(model, cache, engine, per_question)
        assert found == expected, (name, engine)
        allowed = [e.name for e in engine_order(engine)]  # what ran is this setting's or one after it in its order
        assert used.question in allowed and used.steps in allowed
        assert used.steps in ("torch", "reference")  # no 4/8-bit blocks: no C decode step


def test_a_bf16_model_is_reported_as_the_torch_engine_it_runs_on():
    """In bf16 nothing of the native engine applies (its parts and the codes' attention are fp32): the pass and the
    steps are PyTorch's ops, and `used` says torch, not native."""
    import torch

    model = build_tiny("llama-gqa").to(torch.bfloat16)
    cache = prefill(model, ids(PROMPT, 1), None)
    _, used = answers(model, cache, "auto", Cut(64, 8), tokens=4)
    assert used.question == used.steps == "torch"


@pytest.mark.skipif(not has_kernels, reason=f"no C kernels: {native.unavailable_reason()}")
@pytest.mark.parametrize("variant", native.runnable_variants() if has_kernels else [])
def test_the_native_engine_answers_as_the_model_forward_with_every_kernel_variant(variant, monkeypatch, tmp_path):
    """A tiny Llama on exact 4/8-bit blocks: native (C layers, a saved layer attended from its codes) with each
    variant this CPU runs, torch and reference give the same tokens, over a saved 8/4-bit cache cut per question."""
    monkeypatch.setenv(native.SETTING, variant)
    model = on_blocks(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # head_dim 64: codes read
    cache = saved(model, Bits(8, 4), tmp_path / "cache.snapkv")  # deferred: attended from its codes
    expected, _ = answers(model, cache, "reference", Cut(64, 8))
    found, used = answers(model, cache, "native", Cut(64, 8))
    assert found == expected and used.question == used.steps == "native" and used.kernels == variant
    assert answers(model, cache, "torch", Cut(64, 8))[0] == expected


def test_the_engine_in_force_is_read_from_the_environment(monkeypatch):
    from snapkv.compression.config import engine_setting

    monkeypatch.setenv("SNAPKV_ENGINE", "Torch")
    assert engine_setting() == "torch" and engine_setting("reference") == "reference"
    monkeypatch.setenv("SNAPKV_ENGINE", "warp")
    with pytest.raises(ConfigError, match="SNAPKV_ENGINE"):
        engine_setting()


@pytest.mark.slow
def test_every_engine_answers_as_the_model_forward_on_the_embedded_model(embedded_home, monkeypatch, tmp_path):
    """The embedded model in fp32 (its weights found back as 4/8-bit blocks), a saved default-tier cache of the
    sample report cut to the default budget per question: every engine, and the native one with each kernel
    variant this CPU runs, answers three questions token for token as the model's own forward."""
    from snapkv.io.documents import read_sources
    from snapkv.engine.models import load_model
    from snapkv.session import Session

    monkeypatch.setenv("SNAPKV_HOME", str(embedded_home))
    loaded = load_model(dtype="float32")
    session = Session(loaded, SnapKVConfig(budget=256))
    prepared = session.prepare(session.prompt(read_sources("samples/annual_report.txt")))
    questions = ["What was the 2023 revenue?", "Who chairs the board?", "When is the next meeting?"]
    settings = [(engine, None) for engine in ENGINE_CHOICES if engine != "compiled"]
    if has_kernels:
        settings += [("native", variant) for variant in native.runnable_variants()]
    for question in questions:
        ids_ = session.prompter.question_ids(question, "")
        expected = None
        for engine, variant in settings:
            if variant:
                monkeypatch.setenv(native.SETTING, variant)
            used = EngineUse()
            found = list(answer(loaded.model, prepared.cache, ids_, per_question=prepared.per_question,
                                max_new_tokens=24, stop_ids=loaded.stop_ids, engine=engine, used=used))
            monkeypatch.delenv(native.SETTING, raising=False)
            expected = found if expected is None else expected
            assert found == expected, (question, engine, variant, loaded.tokenizer.decode(found),
                                       loaded.tokenizer.decode(expected))
            if engine == "native" and has_kernels:
                assert used.steps == "native" and used.kernels == (variant or native.runnable_variants()[0])


@pytest.mark.slow
def test_ask_json_says_which_engine_answered(home, cli):
    result = cli("ask", "samples/annual_report.txt", "What was the 2023 revenue?", "--json", "--engine", "torch",
                 "--max-new-tokens", "4", "--no-server")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["engine"]["name"] in ("torch", "reference") and report["engine"]["kernels"] == native.variant()
    assert report["answers"][0]["engine"] == report["engine"]
    bad = cli("ask", "samples/annual_report.txt", "Q", "--engine", "warp", "--no-server")
    assert bad.code == 2 and "'warp' is not one of" in bad.stderr
    assert "Traceback" not in bad.stderr
