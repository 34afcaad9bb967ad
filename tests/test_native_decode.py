"""The decode step in one C call (snapkv.engine.native_decode, snapkv/native/kernels/decode_step.c) against the lean step it
stands in for, on tiny Llama models whose weights are exact 4/8-bit blocks."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.cache_utils import DynamicLayer

from snapkv.engine import lean_decode, native_decode, native_question, torch_question
from snapkv import native
from snapkv.modeling.block_weights import use_block_weights
from snapkv.compression.config import Cut
from snapkv.engine.generation import answer, prefill, run_forward
from snapkv.modeling.presized import presize
from snapkv.engine.working_cache import WorkingCache

from conftest import COMMON, build_tiny
from test_block_weights import snap_to_blocks

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"kernels unavailable: {native.unavailable_reason()}")

PROMPT = 203  # not a multiple of 8 (the attention's tail of keys) and past one 128-key chunk
QUESTION = 12


def on_blocks(name: str = "llama-gqa", **config):
    """A tiny model (a TINY_CONFIGS name, or a Llama with `config` over the shared sizes) rounded to blocks."""
    if config:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, **config}), attn_implementation="sdpa")
        model = model.eval()
    else:
        model = build_tiny(name)
    snap_to_blocks(model)
    use_block_weights(model)
    return model


def ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed))


def after_question(model, room: int):
    """Two working caches of one prompt after the same question's pass, presized with `room` slots."""
    cache = prefill(model, ids(PROMPT, 1), None)
    positions = torch.arange(PROMPT, PROMPT + QUESTION).unsqueeze(0)
    workings = []
    for _ in range(2):
        working = WorkingCache.of(cache, model.config)
        run_forward(model, ids(QUESTION, 2).unsqueeze(0), working, positions)
        presize(working, room)
        workings.append(working)
    return workings


@pytest.mark.parametrize("heads", [dict(num_attention_heads=4, num_key_value_heads=2),  # groups of 2
                                   dict(num_attention_heads=4, num_key_value_heads=4),  # one query head per KV head
                                   dict(num_attention_heads=8, num_key_value_heads=1)])  # a group of 8, head_dim 8
def test_native_step_is_the_lean_step_within_rounding(heads):
    """Logits and the keys/values written agree with the lean step's to fp32 rounding, token after token, for
    grouped and plain heads; the C step reads the cache where it is and writes each token into the answer's next
    slot."""
    model = on_blocks(**heads)
    lean, natively = after_question(model, room=8)
    stepper = native_decode.for_cache(model, natively, PROMPT + QUESTION, 8)
    assert stepper is not None
    for step, token in enumerate([5, 17, 99, 3, 250]):
        position = PROMPT + QUESTION + step
        expected = lean_decode.decode_step(model, token, position, lean)
        found = stepper.step(token, position)
        assert torch.allclose(found, expected, rtol=1e-4, atol=1e-5 * expected.abs().max())
    stepper.sync()
    for lean_layer, native_layer in zip(lean.layers, natively.layers):
        expected_shape = (1, heads["num_key_value_heads"], PROMPT + QUESTION + 5, 64 // heads["num_attention_heads"])
        assert native_layer.keys.shape == lean_layer.keys.shape == expected_shape
        assert torch.allclose(native_layer.keys, lean_layer.keys, atol=1e-5)
        assert torch.allclose(native_layer.values, lean_layer.values, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_answers_use_the_native_step_and_are_the_lean_steps_token_for_token(tied, monkeypatch):
    model = build_tiny("llama-gqa")
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.get_input_embeddings().weight
    snap_to_blocks(model)
    use_block_weights(model)
    cache = prefill(model, ids(PROMPT, 1), None)
    steps = []
    real_step = native_decode.NativeDecoder.step
    monkeypatch.setattr(native_decode.NativeDecoder, "step", lambda *a: steps.append(1) or real_step(*a))
    for cut in (None, Cut(64, 8)):
        expected = list(answer(model, cache, ids(QUESTION, 2), per_question=cut, max_new_tokens=24, engine="torch"))
        assert not steps
        found = list(answer(model, cache, ids(QUESTION, 2), per_question=cut, max_new_tokens=24))
        assert found == expected
        assert len(steps) == len(found) - 1  # every token after the question pass's
        steps.clear()


def test_the_logits_in_one_c_call_are_the_modules_within_rounding_and_a_head_it_cannot_read_stays_with_them():
    model = on_blocks()
    hidden = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(4))  # (1, rows, hidden): the last row
    expected = model.lm_head(lean_decode.rms_norm(model.model.norm, hidden[:, -1:]))[0, -1].detach()
    head = native_decode.output_head(model)
    assert head is not None and head.matrix.bits == 8
    found = native_decode.output_logits(model, hidden, head)
    assert found.shape == expected.shape == (model.config.vocab_size,)
    assert torch.allclose(found, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
    model.lm_head = torch.nn.Linear(64, model.config.vocab_size, bias=True)  # a bias: final_logits has none
    assert native_decode.output_head(model) is None
    expected = model.lm_head(lean_decode.rms_norm(model.model.norm, hidden[:, -1:]))[0, -1].detach()
    assert torch.equal(native_decode.output_logits(model, hidden, None), expected)


def test_a_full_buffer_hands_over_to_the_lean_step_with_nothing_lost():
    """When a layer has no free slot the C call writes nothing and says so; after sync the lean step grows the
    buffers and goes on: the same logits as the lean step all along."""
    model = on_blocks()
    lean, natively = after_question(model, room=2)
    stepper = native_decode.for_cache(model, natively, PROMPT + QUESTION, 2)
    tokens = [5, 17, 99, 3]
    for step, token in enumerate(tokens):
        position = PROMPT + QUESTION + step
        expected = lean_decode.decode_step(model, token, position, lean)
        found = stepper.step(token, position) if stepper is not None else None
        if found is None and stepper is not None:
            assert step == 2  # the room held two tokens
            stepper.sync()
            stepper = None
        if stepper is None:
            found = lean_decode.decode_step(model, token, position, natively)
        assert torch.allclose(found, expected, rtol=1e-4, atol=1e-5 * expected.abs().max())
    assert all(layer.keys.shape[2] == PROMPT + QUESTION + len(tokens) for layer in natively.layers)


def test_a_matrix_of_another_shape_is_refused_before_anything_is_written():
    model = on_blocks()
    _, natively = after_question(model, room=4)
    stepper = native_decode.for_cache(model, natively, PROMPT + QUESTION, 4)
    stepper._layers[2].down.inputs += 32  # as if the blocks were another matrix's
    with pytest.raises(MemoryError):  # status -1
        stepper.step(5, PROMPT + QUESTION)
    assert [(layer.held, layer.filled) for layer in stepper._layers] == [(PROMPT + QUESTION, 0)] * 3


def test_models_and_caches_it_does_not_take_stay_with_the_lean_step(monkeypatch):
    plain = build_tiny("llama-gqa")  # fp32 weights, no blocks
    _, working = after_question(plain, room=4)
    assert lean_decode.qualifies(plain, working)
    assert native_decode.for_cache(plain, working, PROMPT + QUESTION, 4) is None
    gemma3 = on_blocks("gemma3")  # its own norms (1 + weight), around the MLP too: the model's forward
    _, working = after_question(gemma3, room=4)
    assert native_decode.for_cache(gemma3, working, PROMPT + QUESTION, 4) is None
    assert native_decode.question_layers(gemma3) is None
    model = on_blocks()
    cache = WorkingCache.of(prefill(model, ids(PROMPT, 1), None), model.config)  # not presized: read where it is
    layers = list(cache.layers)
    stepper = native_decode.for_cache(model, cache, PROMPT, 4)
    assert stepper is not None and stepper.step(5, PROMPT) is not None
    assert all(now is before and type(now) is DynamicLayer and now.keys.shape[2] == PROMPT
               for now, before in zip(cache.layers, layers))  # untouched until sync
    assert all(layer.held_keys == now.keys.data_ptr() and layer.filled == 1
               for layer, now in zip(stepper._layers, cache.layers))  # no copy: the C step reads the cache's tensors
    _, working = after_question(model, room=4)
    assert native_decode.for_cache(model, working, PROMPT + QUESTION, 4) is not None
    monkeypatch.setenv(native.SETTING, "off")
    assert native_decode.for_cache(model, working, PROMPT + QUESTION, 4) is None


@pytest.mark.parametrize("heads", [dict(num_attention_heads=4, num_key_value_heads=2),
                                   dict(num_attention_heads=8, num_key_value_heads=1)])
def test_native_question_layers_are_the_lean_pass_within_rounding(heads, monkeypatch):
    """A question's pass with each layer's parts around its attention in C (native_decode.QuestionLayers: norms,
    fused products, RoPE, SiLU) against the same pass in PyTorch's ops: logits and the cached keys and values within
    fp32 rounding, the same positions kept by the cut; answer() takes the C parts by default, and its tokens are
    those of the torch engine."""
    from snapkv.compression.compress import CompressionPlan

    model = on_blocks(**heads)
    layers = native_decode.question_layers(model)
    assert layers is not None
    cache = prefill(model, ids(PROMPT, 1), None)
    question = ids(QUESTION, 2)
    found = {}
    for label in ("lean", "native"):
        working = WorkingCache.of(cache, model.config)
        plan = CompressionPlan(Cut(64, 8), window=QUESTION)
        if label == "lean":
            logits = torch_question.question_pass(model, question, PROMPT, working, plan)
        else:
            logits = native_question.question_pass(model, question, PROMPT, working, plan, layers)
        found[label] = (logits, plan.kept, working)
    (lean_logits, lean_kept, lean_cache), (logits, kept, native_cache) = found.values()
    assert torch.allclose(logits, lean_logits, rtol=1e-4, atol=1e-5 * lean_logits.abs().max())
    assert kept.keys() == lean_kept.keys() and all(torch.equal(kept[i], lean_kept[i]) for i in kept)
    for lean_layer, native_layer in zip(lean_cache.layers, native_cache.layers):
        assert native_layer.keys.shape == lean_layer.keys.shape == (1, heads["num_key_value_heads"],
                                                                    kept[0].shape[-1], 64 // heads["num_attention_heads"])
        assert torch.allclose(native_layer.keys, lean_layer.keys, atol=1e-5)
        assert torch.allclose(native_layer.values, lean_layer.values, atol=1e-5)
    calls = []
    before = native_decode.QuestionLayers.before
    monkeypatch.setattr(native_decode.QuestionLayers, "before", lambda self, *a: calls.append(1) or before(self, *a))
    for cut in (None, Cut(64, 8)):
        calls.clear()
        tokens = list(answer(model, cache, question, per_question=cut, max_new_tokens=8))
        assert len(calls) == len(model.model.layers)
        assert list(answer(model, cache, question, per_question=cut, max_new_tokens=8, engine="torch")) == tokens


LLAMA3_ROPE = dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=128))


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "llama3"])
def test_every_plain_family_runs_in_c_and_answers_as_the_torch_engine(family, monkeypatch):
    """Each family the C step takes, on a tiny model in 4/8-bit blocks: Mistral; Qwen2 (q, k, v biases, added after
    the fused product); Qwen3 (each q and k head RMS-normed before RoPE); Llama 3's rope scaling (positions past the
    original 128, so the scaled frequencies matter). The question's layers and every step in C give the lean pass's
    logits within fp32 rounding, and answer() gives the torch engine's tokens, full cache and a cut."""
    model = (on_blocks(**LLAMA3_ROPE, num_attention_heads=4, num_key_value_heads=2) if family == "llama3"
             else on_blocks(family))
    layers = native_decode.question_layers(model)
    assert layers is not None, family
    if family == "qwen2":
        assert native_decode._model_layers(model).layers[0].qkv_bias is not None
    if family == "qwen3":
        assert all(layer.q_norm and layer.k_norm for layer in native_decode._model_layers(model).layers)
    cache = prefill(model, ids(PROMPT, 1), None)
    question = ids(QUESTION, 2)
    logits = {}
    for label in ("lean", "native"):
        working = WorkingCache.of(cache, model.config)
        if label == "lean":
            logits[label] = torch_question.question_pass(model, question, PROMPT, working, None)
        else:
            logits[label] = native_question.question_pass(model, question, PROMPT, working, None, layers)
    assert torch.allclose(logits["native"], logits["lean"], rtol=1e-4, atol=1e-5 * logits["lean"].abs().max())
    lean, natively = after_question(model, room=4)
    stepper = native_decode.for_cache(model, natively, PROMPT + QUESTION, 4)
    assert stepper is not None
    for step, token in enumerate([5, 17, 99]):
        position = PROMPT + QUESTION + step
        expected = lean_decode.decode_step(model, token, position, lean)
        assert torch.allclose(stepper.step(token, position), expected, rtol=1e-4, atol=1e-5 * expected.abs().max())
    steps = []
    real_step = native_decode.NativeDecoder.step
    monkeypatch.setattr(native_decode.NativeDecoder, "step", lambda *a: steps.append(1) or real_step(*a))
    for cut in (None, Cut(64, 8)):
        expected = list(answer(model, cache, question, per_question=cut, max_new_tokens=16, engine="torch"))
        steps.clear()
        assert list(answer(model, cache, question, per_question=cut, max_new_tokens=16)) == expected
        assert len(steps) == len(expected) - 1
