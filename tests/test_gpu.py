"""GPU checks (marked gpu, skipped without CUDA): the same engine on CUDA, flash-attn, a model split
between the GPU and the CPU, and per-phase CUDA peaks. Run on a GPU machine by scripts/gpu_check.sh."""

import importlib.util

import pytest
import torch

from conftest import build_tiny
from snapkv.compression.config import Cut
from snapkv.engine.generation import answer, prefill
from snapkv.engine.memory import PeakMemory, estimate_prefill
from snapkv.storage.cachefile import load_cache, save_cache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

IDS = torch.arange(3, 803) % 250 + 3  # (800,)
SETTINGS = Cut(128, 16)


def kept_agreement(a, b) -> float:
    """Share of kept positions two caches have in common, over every layer and head."""
    shared = total = 0
    for x, y in zip(a.positions, b.positions):
        for row_x, row_y in zip(x.cpu().tolist(), y.cpu().tolist()):
            shared += len(set(row_x) & set(row_y))
            total += len(row_x)
    return shared / total


def test_cuda_keeps_what_the_cpu_keeps():
    model = build_tiny("llama-gqa")
    on_cpu = prefill(model, IDS, SETTINGS)
    on_gpu = prefill(model.to("cuda"), IDS, SETTINGS)
    assert on_gpu.keys[0].device.type == "cuda"
    assert kept_agreement(on_cpu, on_gpu) >= 0.99


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed")
def test_flash_attention_keeps_what_sdpa_keeps():
    sdpa = build_tiny("llama-gqa").to("cuda", torch.bfloat16)
    flash = build_tiny("llama-gqa", attn_implementation="flash_attention_2").to("cuda", torch.bfloat16)
    a, b = prefill(sdpa, IDS, SETTINGS), prefill(flash, IDS, SETTINGS)
    assert kept_agreement(a, b) >= 0.95
    assert len(list(answer(flash, b, torch.tensor([7, 8, 9]), max_new_tokens=8))) == 8


def test_model_split_between_gpu_and_cpu(tmp_path):
    """accelerate's device_map: each layer's cache on its layer's device; saved, it loads into one GPU."""
    from accelerate import dispatch_model

    model = build_tiny("llama-gqa")
    reference = prefill(model, IDS, SETTINGS)
    question = torch.tensor([7, 8, 9])
    expected = list(answer(model, reference, question, max_new_tokens=8))
    split = dispatch_model(build_tiny("llama-gqa"), device_map={
        "model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
        "model.layers.2": "cpu", "model.norm": "cpu", "lm_head": "cpu"})
    cache = prefill(split, IDS, SETTINGS)
    assert [k.device.type for k in cache.keys] == ["cuda", "cuda", "cpu"]
    assert kept_agreement(reference, cache) >= 0.99
    assert list(answer(split, cache, question, max_new_tokens=8)) == expected
    path = tmp_path / "split.snapkv"
    save_cache(path, cache)
    on_gpu, _ = load_cache(path, device="cuda")
    assert list(answer(model.to("cuda"), on_gpu, question, max_new_tokens=8)) == expected


def test_phase_peaks_and_the_estimate():
    model = build_tiny("llama-gqa").to("cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.arange(3, 8003) % 250 + 3
    with PeakMemory(torch.device("cuda")) as memory:
        prefill(model, ids, SETTINGS)
    assert memory.peak > weights
    estimate = estimate_prefill(model.config, ids.shape[0], torch.float32, SETTINGS, device_type="cuda")
    print(f"prefill peak beyond weights {memory.peak - weights} bytes, estimate {estimate.total_bytes}")
    assert memory.peak - weights <= estimate.total_bytes
