"""Scale on CPU: MLPs run in slices, the memory estimate, device_map loading, caches across device layouts.

The GPU side (flash-attn, 128k-1M tokens, several GPUs) needs a GPU machine; see README "GPU".
"""

import json
from pathlib import Path

import pytest
import torch

from conftest import build_tiny
from snapkv.modeling.architectures import feed_forward_modules
from snapkv.modeling.chunking import chunked_feed_forward
from snapkv.compression.config import Cut, SnapKVConfig
from snapkv.io.documents import Document
from snapkv.base.errors import IncompatibleCacheError, OutOfMemoryError
from snapkv.engine.generation import answer, prefill
from snapkv.engine.memory import check_prefill_fits, estimate_prefill
from snapkv.engine.models import load_model
from snapkv.session import Session
from snapkv.storage.cachefile import load_cache, save_cache

IDS = torch.arange(3, 203) % 250 + 3  # (200,) a prompt for the tiny models


@pytest.mark.parametrize("settings", [None, Cut(64, 8)], ids=["full", "snapkv"])
def test_mlp_in_slices_gives_the_same_cache(tiny_model, settings):
    whole = prefill(tiny_model, IDS, settings)
    sliced = prefill(tiny_model, IDS, settings, chunk_tokens=16)
    for a, b in zip(whole.positions, sliced.positions):
        assert torch.equal(a, b)
    for a, b in zip(whole.keys + whole.values, sliced.keys + sliced.values):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    question = torch.tensor([7, 8, 9])
    assert list(answer(tiny_model, whole, question, max_new_tokens=8)) == \
        list(answer(tiny_model, sliced, question, max_new_tokens=8))


def test_each_slice_reaches_the_mlp_with_strides_of_its_own():
    """A slice of the prompt keeps the prompt's batch stride, and torch's matmul then copies the weight per call."""
    model = build_tiny("llama-gqa")
    strides = []
    handles = [mlp.gate_proj.register_forward_pre_hook(lambda module, args: strides.append(args[0].stride()))
               for mlp in feed_forward_modules(model)]
    prefill(model, IDS, None, chunk_tokens=48)
    for handle in handles:
        handle.remove()
    assert strides and all(stride == (rows * 64, 64, 1) for stride, rows in
                           zip(strides, [48, 48, 48, 48, 8] * len(handles)))


def test_slicing_really_bounds_what_the_mlp_sees():
    model = build_tiny("llama-gqa")
    seen = []  # positions each call of an MLP's down projection receives
    handles = [mlp.down_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
               for mlp in feed_forward_modules(model)]
    prefill(model, IDS, None, chunk_tokens=48)
    for handle in handles:
        handle.remove()
    assert max(seen) == 48 and sum(seen) == 200 * len(feed_forward_modules(model))


def test_slicing_restores_an_instance_forward():
    """accelerate's device_map hooks live in module.forward; slicing must put them back."""
    model = build_tiny("llama-gqa")
    mlp = feed_forward_modules(model)[0]
    hooked = mlp.forward  # stands in for accelerate's wrapper
    mlp.forward = hooked
    with chunked_feed_forward(model, 8):
        assert mlp.forward is not hooked
    assert mlp.forward is hooked
    assert "forward" not in feed_forward_modules(model)[1].__dict__


# ------------------------------------------------------------------------------------------ estimate

def test_estimate_counts_the_kv_exactly():
    model = build_tiny("llama-gqa")
    per_token_layer = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16, fp32
    full = estimate_prefill(model.config, 200, torch.float32, None)
    assert full.kv_bytes == prefill(model, IDS, None).kv_bytes == 3 * 200 * per_token_layer
    tier = Cut(64, 8)
    compressed = estimate_prefill(model.config, 200, torch.float32, tier)
    cut = prefill(model, IDS, tier)
    # at the peak: the last layer's whole cache, the others already cut to the budget
    assert compressed.kv_bytes == cut.kv_bytes + (200 - 64) * per_token_layer
    assert compressed.full_layer_kv_bytes == 200 * per_token_layer
    assert estimate_prefill(model.config, 400, torch.float32, tier).activation_bytes > compressed.activation_bytes


def test_estimate_bounds_the_mlp_by_the_slice():
    from transformers import AutoConfig

    shape = json.loads((Path(__file__).parent.parent / "samples" / "configs" / "llama-3.1-8b.json").read_text())
    config = AutoConfig.for_model(**shape)
    tier = Cut(4096, 32)
    sliced = estimate_prefill(config, 2**20, torch.bfloat16, tier, chunk_tokens=16384, device_type="cuda")
    whole = estimate_prefill(config, 2**20, torch.bfloat16, tier, chunk_tokens=2**20, device_type="cuda")
    mlp_whole = 2**20 * 2 * 3 * config.intermediate_size
    assert whole.activation_bytes - sliced.activation_bytes == mlp_whole - 16384 * 2 * 3 * config.intermediate_size
    # 1M tokens at budget 4096 of this shape: what the estimate expects beside 16 GB of weights on an H200
    assert sliced.total_bytes < 100 * 2**30 < whole.total_bytes


def test_preflight_refuses_with_the_numbers(monkeypatch):
    model = build_tiny("llama-gqa")
    device = torch.device("cpu")
    assert check_prefill_fits(model, 200, device, torch.float32, None).tokens == 200
    monkeypatch.setattr("snapkv.engine.memory.free_bytes", lambda device: 2**20)
    with pytest.raises(OutOfMemoryError, match=r"prefilling 200000 tokens needs about .* GiB is free on cpu"):
        check_prefill_fits(model, 200_000, device, torch.float32, None)


# ---------------------------------------------------------------------------------- device layouts

@pytest.fixture
def tiny_folder(tiny_loaded, tmp_path) -> Path:
    folder = tmp_path / "tiny-model"
    tiny_loaded.model.save_pretrained(folder)
    tiny_loaded.tokenizer.save_pretrained(folder)
    return folder


def test_device_map_loads_and_caches_cross_layouts(tiny_folder, tmp_path):
    plain = load_model(str(tiny_folder), device="cpu", dtype="float32")
    mapped = load_model(str(tiny_folder), device="cpu", dtype="float32", device_map="auto")
    assert mapped.layer_devices == [torch.device("cpu")] * 3
    assert mapped.identity == plain.identity
    document = Document(" ".join(f"Row {i}: the mill ground {i * 7} sacks." for i in range(30)))
    settings = SnapKVConfig(budget=48, window=8, query_aware=False)
    saved_from = Session(plain, settings)
    prepared = saved_from.prepare(document)
    path = tmp_path / "plain.snapkv"
    saved_from.save(prepared, path)
    loaded_into = Session(mapped, settings).load_file(path)
    question = "How many sacks in row 3?"
    first = "".join(saved_from.ask(prepared, question, max_new_tokens=8))
    second = "".join(Session(mapped, settings).ask(loaded_into, question, max_new_tokens=8))
    assert first == second


def test_cache_loads_into_another_layout_and_dtype(tmp_path):
    model = build_tiny("llama-gqa")
    cache = prefill(model, IDS, Cut(64, 8))
    path = tmp_path / "c.snapkv"
    save_cache(path, cache)
    per_layer = [torch.device("cpu")] * 3
    moved, _ = load_cache(path, device=per_layer, dtype=torch.bfloat16)
    assert [k.device for k in moved.keys] == per_layer and moved.keys[0].dtype == torch.bfloat16
    torch.testing.assert_close(moved.values[2].float(), cache.values[2], rtol=1e-2, atol=1e-2)
    with pytest.raises(IncompatibleCacheError, match="3 layers"):
        load_cache(path, device=per_layer[:2])
