"""Plain bf16/fp32 weights in the native engine (snapkv.modeling.dense_weights, snapkv/native/kernels/dense_rows.c): the
product against a float64 reference, the fused rows, and a bf16 model's decode in C against the lean step over the same
weights in fp32."""

import copy

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from snapkv import native
from snapkv.compression.config import Cut
from snapkv.engine import lean_decode, native_decode
from snapkv.engine.engines import EngineUse
from snapkv.engine.generation import answer, prefill, run_forward
from snapkv.modeling.dense_weights import dense_matmul, fuse_dense, fused_dense
from snapkv.modeling.presized import PresizedLayer, presize

from conftest import build_tiny

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"kernels unavailable: {native.unavailable_reason()}")

PROMPT, QUESTION = 203, 12


def ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("wide", [False, True])
def test_the_dense_product_is_the_float64_product_of_the_same_weights(dtype, rows, wide, vector_width):
    """y = x @ W^T summed in fp32 from bf16 or fp32 rows, for input sizes that end mid-vector (8, 24, 40) and ones
    that do not, one row (the decode's kernel, 8 or 16 lanes) and several (few_rows.c's tiles)."""
    vector_width(wide)
    generator = torch.Generator().manual_seed(3)
    for inputs in (8, 24, 40, 64, 576):
        weight = torch.randn(37, inputs, generator=generator).to(dtype)  # 37 outputs: not a multiple of the threads'
        x = torch.randn(rows, inputs, generator=generator)
        found = dense_matmul(x, weight)
        expected = x.double() @ weight.double().T  # the weights' exact values (a bf16 weight is an fp32 value)
        assert found is not None and found.shape == (rows, 37)
        assert (found.double() - expected).abs().max() < 1e-5 * inputs ** 0.5 * expected.abs().max()
    assert dense_matmul(torch.randn(1, 12), torch.randn(3, 12).to(dtype)) is None  # an input size not a multiple of 8


def test_fusing_points_each_projection_at_its_rows_and_changes_no_logit():
    model = build_tiny("llama-gqa").to(torch.bfloat16)
    tokens = ids(40, 1).unsqueeze(0)
    with torch.inference_mode():
        before = model(tokens).logits
    assert fuse_dense(model) == 2 * len(model.model.layers)  # q/k/v and gate/up of every layer
    attention = model.model.layers[0].self_attn
    fused = fused_dense(attention, lean_decode.QKV)
    assert fused.dtype == torch.bfloat16 and fused.shape == (64 + 2 * 32, 64)
    assert attention.k_proj.weight.data_ptr() == fused[64:].data_ptr()  # a view of its rows: no second copy
    with torch.inference_mode():
        assert torch.equal(model(tokens).logits, before)
    assert fuse_dense(model) == 0  # already fused


def test_projections_with_biases_are_left_as_they_are():
    model = build_tiny("qwen2")  # q/k/v with biases, gate/up without
    fuse_dense(model)
    layer = model.model.layers[0]
    assert fused_dense(layer.self_attn, lean_decode.QKV) is None
    assert fused_dense(layer.mlp, lean_decode.GATE_UP) is not None


def twins(dtype: torch.dtype):
    """A tiny model in `dtype` with fused plain weights, and its twin in fp32 holding the very same values."""
    model = build_tiny("llama-gqa").to(dtype)
    twin = copy.deepcopy(model).float()
    fuse_dense(model)
    return model, twin


def after_question(model, room: int, dtype: torch.dtype):
    """The working cache of one prompt after a question's pass, as the model computed it (its dtype), and a copy in
    `dtype` presized with `room` slots."""
    cache = prefill(model, ids(PROMPT, 1), None)
    working = cache.to_dynamic_cache(model.config)
    run_forward(model, ids(QUESTION, 2).unsqueeze(0), working, torch.arange(PROMPT, PROMPT + QUESTION).unsqueeze(0))
    reference = copy.deepcopy(working)
    presize(reference, room, dtype=dtype)
    return working, reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_plain_weights_step_is_the_lean_fp32_step_over_the_same_values(dtype):
    """The C step over bf16 (or fp32) rows, with the model's cache copied into fp32 buffers, against the lean step of
    an fp32 twin holding the same weights over the same cache in fp32: logits within fp32 rounding, token after
    token, and the keys and values it wrote."""
    model, twin = twins(dtype)
    working, reference = after_question(model, room=8, dtype=torch.float32)
    stepper = native_decode.for_cache(model, working, PROMPT + QUESTION, 8)
    assert stepper is not None
    assert all(type(layer) is PresizedLayer and layer.keys.dtype == torch.float32 for layer in working.layers)
    for step, token in enumerate([5, 17, 99, 3, 250]):
        position = PROMPT + QUESTION + step
        expected = lean_decode.decode_step(twin, token, position, reference)
        found = stepper.step(token, position)
        assert found.dtype == torch.float32
        assert torch.allclose(found, expected, rtol=1e-4, atol=1e-5 * expected.abs().max())
    for native_layer, lean_layer in zip(working.layers, reference.layers):  # the fp32 buffers the C step wrote
        written = PROMPT + QUESTION + 5
        assert lean_layer.keys.shape[2] == written
        keys, values = (buffer[:, :, :written] for buffer in native_layer.buffers)
        assert torch.allclose(keys, lean_layer.keys, atol=1e-5) and torch.allclose(values, lean_layer.values, atol=1e-5)


def test_a_bf16_cache_handed_over_is_bf16_again_and_the_lean_step_goes_on():
    """When a buffer is full, sync leaves the cache as the bf16 model's own steps read it (plain layers in bf16,
    every written token kept); the lean step then goes on from it."""
    model, _ = twins(torch.bfloat16)
    working, _ = after_question(model, room=2, dtype=torch.float32)
    stepper = native_decode.for_cache(model, working, PROMPT + QUESTION, 2)
    assert stepper.step(5, PROMPT + QUESTION) is not None and stepper.step(17, PROMPT + QUESTION + 1) is not None
    assert stepper.step(99, PROMPT + QUESTION + 2) is None  # the room held two tokens
    stepper.sync()
    assert all(type(layer) is DynamicLayer and layer.keys.dtype == torch.bfloat16 for layer in working.layers)
    assert working.get_seq_length() == PROMPT + QUESTION + 2
    logits = lean_decode.decode_step(model, 99, PROMPT + QUESTION + 2, working)
    assert logits.shape == (model.config.vocab_size,) and working.get_seq_length() == PROMPT + QUESTION + 3


def test_a_model_it_does_not_take_leaves_the_cache_untouched():
    model = build_tiny("llama-gqa").to(torch.bfloat16)  # not fused: no matrix the C step reads
    working, _ = after_question(model, room=4, dtype=torch.float32)
    assert native_decode.for_cache(model, working, PROMPT + QUESTION, 4) is None
    assert all(type(layer) is DynamicLayer and layer.keys.dtype == torch.bfloat16 for layer in working.layers)


def test_a_bf16_models_answer_steps_natively_and_says_its_question_pass_was_torchs():
    """answer() on a bf16 model with fused weights: the question pass is the torch engine's (the C parts read fp32),
    every step the native engine's, and EngineUse says so; the first token, from the same question pass, is the torch
    engine's."""
    model, _ = twins(torch.bfloat16)
    cache = prefill(model, ids(PROMPT, 1), None)
    for cut in (None, Cut(64, 8)):
        used = EngineUse()
        tokens = list(answer(model, cache, ids(QUESTION, 2), per_question=cut, max_new_tokens=6, used=used))
        assert (used.question, used.steps) == ("torch", "native") and len(tokens) == 6
        by_torch = list(answer(model, cache, ids(QUESTION, 2), per_question=cut, max_new_tokens=1, engine="torch"))
        assert tokens[:1] == by_torch
