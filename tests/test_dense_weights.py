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
from snapkv.modeling.dense_weights import Bf16Linear, dense_matmul, fuse_dense, fused_dense, narrow_exact_bf16
from snapkv.modeling.presized import presize
from snapkv.engine.working_cache import WorkingCache

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


def test_projections_with_biases_are_fused_and_keep_their_biases():
    """Qwen2's q/k/v with biases: their weights fused like any others, each bias left on its Linear (the C step adds
    them apart, native_decode._qkv_bias); the model's outputs unchanged."""
    model = build_tiny("qwen2").to(torch.bfloat16)  # q/k/v with biases, gate/up without
    tokens = ids(20, 3).unsqueeze(0)
    with torch.inference_mode():
        before = model(tokens).logits
    biases = [model.model.layers[0].self_attn.q_proj.bias.clone()]
    assert fuse_dense(model) == 2 * len(model.model.layers)
    layer = model.model.layers[0]
    assert fused_dense(layer.self_attn, lean_decode.QKV) is not None
    assert torch.equal(layer.self_attn.q_proj.bias, biases[0])
    with torch.inference_mode():
        assert torch.equal(model(tokens).logits, before)
    assert native_decode._model_layers(model).layers[0].qkv_bias is not None


def twins(dtype: torch.dtype, name: str = "llama-gqa"):
    """A tiny model in `dtype` with fused plain weights, and its twin in fp32 holding the very same values."""
    model = build_tiny(name).to(dtype)
    twin = copy.deepcopy(model).float()
    fuse_dense(model)
    return model, twin


def after_question(model, room: int, dtype: torch.dtype):
    """The working cache of one prompt after a question's pass, as the model computed it (its dtype), and a copy in
    `dtype` presized with `room` slots."""
    cache = prefill(model, ids(PROMPT, 1), None)
    working = WorkingCache.of(cache, model.config)
    run_forward(model, ids(QUESTION, 2).unsqueeze(0), working, torch.arange(PROMPT, PROMPT + QUESTION).unsqueeze(0))
    reference = copy.deepcopy(working)
    for layer in reference.layers:
        layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
    presize(reference, room)
    return working, reference


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "llama-gqa"), (torch.float32, "llama-gqa"),
                                         (torch.bfloat16, "qwen2"), (torch.bfloat16, "qwen3")])
def test_a_plain_weights_step_is_the_lean_fp32_step_over_the_same_values(dtype, name):
    """The C step over bf16 (or fp32) rows, reading the model's cache where it is (bf16 widened exactly), against the
    lean step of an fp32 twin holding the same weights over the same cache in fp32: logits within fp32 rounding, token
    after token, and the keys and values it wrote (fp32, the answer's own); a Llama, Qwen2 (biases) and Qwen3 (q and k
    norms)."""
    model, twin = twins(dtype, name)
    working, reference = after_question(model, room=8, dtype=torch.float32)
    stepper = native_decode.for_cache(model, working, PROMPT + QUESTION, 8)
    assert stepper is not None
    assert all(type(layer) is DynamicLayer and layer.keys.dtype == dtype for layer in working.layers)  # no copy
    for step, token in enumerate([5, 17, 99, 3, 250]):
        position = PROMPT + QUESTION + step
        expected = lean_decode.decode_step(twin, token, position, reference)
        found = stepper.step(token, position)
        assert found.dtype == torch.float32
        assert torch.allclose(found, expected, rtol=1e-4, atol=1e-5 * expected.abs().max())
    for index, lean_layer in enumerate(reference.layers):  # the cache's rows, then the fp32 rows the C step wrote
        keys, values = stepper.written(index)
        assert keys.shape == lean_layer.keys.shape and lean_layer.keys.shape[2] == PROMPT + QUESTION + 5
        assert torch.allclose(keys, lean_layer.keys, atol=1e-5) and torch.allclose(values, lean_layer.values, atol=1e-5)


def test_a_bf16_cache_read_where_it_is_gives_the_logits_of_its_fp32_copy_to_the_bit():
    """decode_token over a bf16 model's bf16 cache (read where it is, each value widened in the attention) and over
    the same cache widened to fp32 first: the same logits to the bit, token after token, including the tokens whose
    keys are read 8 at a time across the cache's last rows and the answer's first (215 rows held: not a multiple of
    8)."""
    model, _ = twins(torch.bfloat16)
    in_bf16, _ = after_question(model, room=8, dtype=torch.float32)
    in_fp32 = copy.deepcopy(in_bf16)
    for layer in in_fp32.layers:
        layer.keys, layer.values = layer.keys.float(), layer.values.float()
    by_bf16 = native_decode.for_cache(model, in_bf16, PROMPT + QUESTION, 8)
    by_fp32 = native_decode.for_cache(model, in_fp32, PROMPT + QUESTION, 8)
    assert {layer.held_bits for layer in by_bf16._layers} == {16}
    assert {layer.held_bits for layer in by_fp32._layers} == {32}
    for step, token in enumerate([5, 17, 99, 3, 250, 7, 8, 9]):
        position = PROMPT + QUESTION + step
        assert torch.equal(by_bf16.step(token, position), by_fp32.step(token, position))


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


def bf16_checkpoint_in_fp32():
    """A tiny fp32 model whose weights are all bf16 values (a bf16 checkpoint loaded in fp32), but one: o_proj of the
    first layer keeps a value bf16 cannot hold."""
    model = build_tiny("llama-gqa").to(torch.bfloat16).float()
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[0, 0] += 1e-6
    return model


def test_exact_bf16_weights_are_held_in_bf16_and_the_autocast_prefill_is_the_same_to_the_bit():
    """narrow_exact_bf16 swaps every linear layer whose fp32 weights are bf16 values (not the one that is not), halving
    their bytes; under the prefill's autocast the logits are those of the fp32 weights to the bit, and outside it (fp32
    rows: a question, a decoded token, a long forward) within fp32 rounding."""
    model = bf16_checkpoint_in_fp32()
    wide = copy.deepcopy(model)
    linears = sum(type(module) is torch.nn.Linear for module in model.modules())
    assert narrow_exact_bf16(model) == linears - 1
    assert type(model.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    assert type(model.model.layers[1].self_attn.o_proj) is Bf16Linear
    assert model.model.layers[1].self_attn.o_proj.weight.dtype == torch.bfloat16
    tokens = ids(90, 4).unsqueeze(0)  # more rows than the few-rows kernel takes: PyTorch's product over widened weights
    with torch.inference_mode():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model(tokens).logits, wide(tokens).logits)
        for length in (1, 12, 90):
            found, expected = model(tokens[:, :length]).logits, wide(tokens[:, :length]).logits
            assert found.dtype == torch.float32
            assert torch.allclose(found, expected, rtol=1e-4, atol=1e-5 * expected.abs().max())


def test_a_tied_output_head_stays_with_the_embeddings():
    model = build_tiny("llama-gqa").to(torch.bfloat16).float()
    model.lm_head.weight = model.get_input_embeddings().weight
    narrow_exact_bf16(model)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.get_input_embeddings().weight


def test_narrowed_weights_decode_natively_question_pass_included():
    """An fp32 model with bf16-held weights, fused: the native engine runs its question pass (C parts over the bf16
    rows) and its steps, with the tokens of the torch engine over the fp32 weights."""
    model = build_tiny("llama-gqa").to(torch.bfloat16).float()
    wide = copy.deepcopy(model)
    narrow_exact_bf16(model)
    fuse_dense(model)
    assert native_decode.question_layers(model) is not None
    cache = prefill(wide, ids(PROMPT, 1), None)
    for cut in (None, Cut(64, 8)):
        used = EngineUse()
        tokens = list(answer(model, cache, ids(QUESTION, 2), per_question=cut, max_new_tokens=8, used=used))
        assert (used.question, used.steps) == ("native", "native")
        assert tokens == list(answer(wide, cache, ids(QUESTION, 2), per_question=cut, max_new_tokens=8, engine="torch"))


def test_the_embedded_model_in_bf16_decodes_natively_and_keeps_its_facts(embedded_home, monkeypatch):
    """`--dtype bfloat16` on CPU: load_model fuses the bf16 weights, every step is the native engine's (the question
    pass the torch engine's), and the sample report's answers state its facts, as the torch engine's do."""
    from snapkv.engine.models import load_model
    from snapkv.io.documents import read_sources
    from snapkv.session import Session
    from snapkv.compression.config import SnapKVConfig

    monkeypatch.setenv("SNAPKV_HOME", str(embedded_home))
    loaded = load_model(dtype="bfloat16")
    assert fused_dense(loaded.model.model.layers[0].mlp, lean_decode.GATE_UP) is not None
    session = Session(loaded, SnapKVConfig(budget=1024))
    prepared = session.prepare(session.prompt(read_sources("samples/annual_report.txt")))
    for question, fact in [("What was the 2023 revenue?", "184.6"), ("Who chairs the board?", "Priya Raman")]:
        ids_ = session.prompter.question_ids(question, "")
        for engine in ("auto", "torch"):
            used = EngineUse()
            tokens = list(answer(loaded.model, prepared.cache, ids_, per_question=prepared.per_question,
                                 max_new_tokens=48, stop_ids=loaded.stop_ids, engine=engine, used=used))
            assert fact in loaded.tokenizer.decode(tokens), (engine, loaded.tokenizer.decode(tokens))
            assert used.steps == ("native" if engine == "auto" else "torch") and used.question == "torch"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_output_head_in_fp32_is_the_fp32_twins_head_within_rounding(dtype):
    """native_decode.output_logits: the final norm and a plain bf16 or fp32 head in one C call (final_logits, the
    head's product by dense_rows.c), the last row only, against the fp32 twin's own norm and head."""
    model, twin = twins(dtype)
    hidden = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(5))
    head = native_decode.output_head(model)
    assert head is not None and head.matrix.bits == {torch.bfloat16: 16, torch.float32: 32}[dtype]
    with torch.inference_mode():
        found = native_decode.output_logits(model, hidden, head)
        expected = twin.lm_head(lean_decode.rms_norm(twin.model.norm, hidden))[0, -1]
    assert found.shape == expected.shape == (model.config.vocab_size,)
    assert torch.allclose(found, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
