"""A question's attention straight from a saved layer's codes (snapkv.engine.coded_attention,
snapkv/native/kernels/coded_attention.c), then the one cut of a layer (snapkv.compression.compress.cut_layer) restoring
only the kept positions, against the same pass over the layer restored to fp32, on a tiny Llama with head_dim 64 whose
weights are exact 4/8-bit blocks."""

import pytest
import torch

from snapkv.engine import coded_attention, native_decode, native_question
from snapkv import native
from snapkv.base.bits import Bits
from snapkv.storage.cachefile import load_cache, save_cache
from snapkv.compression.compress import CompressionPlan
from snapkv.compression.config import Cut
from snapkv.compression.methods import Chunks, SnapKV
from snapkv.engine.generation import answer, prefill
from snapkv.storage.quantize import quantize_mixed, stored_schemes
from snapkv.engine.working_cache import WorkingCache

from test_native_decode import ids, on_blocks

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"the coded path needs snapkv's kernels: {native.unavailable_reason()}")

PROMPT = 203  # past one 128-token key group, not a multiple of 16 or 64: part-filled tiles and groups
QUESTION = 7


def sharper(cache, share: float) -> list[torch.Tensor]:
    """Per layer (kv_heads, kept) bool: `share` of each head's positions, chosen at random, as many in every head."""
    generator = torch.Generator().manual_seed(3)
    masks = []
    for keys in cache.keys:
        heads, kept = keys.shape[0], keys.shape[1]  # (kv_heads, kept, head_dim)
        chosen = torch.zeros(heads, kept, dtype=torch.bool)
        for head in range(heads):
            chosen[head, torch.randperm(kept, generator=generator)[: int(share * kept)]] = True
        masks.append(chosen)
    return masks


def saved(model, bits: Bits, path):
    """A prompt's cache stored in `bits` and loaded deferred, as `ask` loads it."""
    cache = prefill(model, ids(PROMPT, 1), None)
    stored = cache.at_precision(bits, sharper(cache, bits.share) if bits.share else None)
    save_cache(path, stored)
    return load_cache(path, question_room=16)[0]


def coded_calls(monkeypatch) -> list[bool]:
    """Whether each of the pass's attend_coded calls took the coded path (recorded as the pass calls it)."""
    taken = []
    real = native_question.attend_coded
    monkeypatch.setattr(native_question, "attend_coded", lambda *a: (found := real(*a)) is not None and taken.append(True)
                        or (found is None and taken.append(False)) or found)
    return taken


@pytest.mark.parametrize("bits, window, method", [
    (Bits(3, 2, share=0.2, sharp=(8, 4)), QUESTION, SnapKV()),  # two parts, keys 8 unrotated
    (Bits(3, 2, share=0.2, sharp=(8, 4)), QUESTION - 3, SnapKV()),  # a window shorter than the question: its first rows
    (Bits(4, 3), QUESTION, SnapKV()),  # one part, every key and value rotated
    (Bits(8), QUESTION, SnapKV()),  # one part, nothing rotated (the values' sum in their own basis)
    (Bits(8), QUESTION, Chunks(size=8)),  # whole chunks kept, from the codes
    (Bits(4, 3), QUESTION, "words"),  # whole words kept (random words of 1-5 tokens), from the codes
    (Bits(8), QUESTION, "pyramid")])  # more kept in the lower layers, fewer in the upper ones
@pytest.mark.parametrize("heads", [dict(num_attention_heads=4, num_key_value_heads=2),
                                   dict(num_attention_heads=2, num_key_value_heads=2)])
def test_the_coded_path_is_the_restored_path_within_rounding(bits, window, method, heads, tmp_path, monkeypatch,
                                                             vector_width):
    """The same question over the same deferred cache, its attention and cut from the codes and from the layer
    restored whole: logits within fp32 rounding, the same positions kept, the kept stored rows the same to the bit
    (restored as the whole layer's restore gives them) and the question's own rows within rounding (computed from
    the layer before's output)."""
    vector_width(True)  # the 16-lane functions the coded path needs (in plain C outside the avx512 build)
    model = on_blocks(hidden_size=64 * heads["num_attention_heads"], **heads)
    cache = saved(model, bits, tmp_path / "cache.snapkv")
    layers = native_decode.question_layers(model)
    question = ids(QUESTION, 2)
    found = {}
    for way in ("restored", "coded"):
        taken = coded_calls(monkeypatch)
        if way == "restored":
            monkeypatch.setattr(coded_attention, "attend_coded", lambda *a: None)
            monkeypatch.setattr(native_question, "attend_coded", lambda *a: None)
        working = WorkingCache.of(cache, model.config, for_question=True)
        if method == "words":
            plan = CompressionPlan(Cut(64, 8, SnapKV(), whole_words=True), window=window)
            words = torch.repeat_interleave(torch.arange(PROMPT), torch.randint(1, 6, (PROMPT,),
                                            generator=torch.Generator().manual_seed(5)))[:PROMPT]
            plan.words = [words.expand(heads["num_key_value_heads"], -1)] * len(model.model.layers)
        elif method == "pyramid":
            plan = CompressionPlan(Cut(64, 8, SnapKV(), pyramid=True), window=window, layers=len(model.model.layers))
        else:
            plan = CompressionPlan(Cut(64, 8, method), window=window)
        logits = native_question.question_pass(model, question, PROMPT, working, plan, layers)
        found[way] = (logits, plan.kept, [(layer.keys, layer.values) for layer in working.layers])
        monkeypatch.undo()
    assert taken == [True] * len(model.model.layers)  # the coded pass took every layer from its codes
    (restored_logits, restored_kept, restored_states), (logits, kept, states) = found.values()
    assert torch.allclose(logits, restored_logits, rtol=1e-4, atol=1e-5 * restored_logits.abs().max())
    assert kept.keys() == restored_kept.keys() == set(range(len(model.model.layers)))
    assert all(torch.equal(kept[i], restored_kept[i]) for i in kept)
    for index, ((keys, values), (restored_keys, restored_values)) in enumerate(zip(states, restored_states)):
        assert keys.shape == (1, heads["num_key_value_heads"], plan.prefix_keep_at(index) + window, 64)
        stored = kept[index][0] < PROMPT  # (kv_heads, kept): the cache's positions, not the question's own
        for got, want in ((keys, restored_keys), (values, restored_values)):
            assert torch.equal(got[0][stored], want[0][stored])  # stored rows: to the bit
            assert torch.allclose(got[0][~stored], want[0][~stored], atol=1e-5)  # the question's


def test_answers_take_the_coded_path_and_match_the_restored_path(tmp_path, monkeypatch, vector_width):
    """answer() over a deferred cache takes the coded path in every layer its cut applies to (where the 16-lane
    functions are in use), and gives the tokens the restored path gives; the torch engine (PyTorch's ops, the model's
    bits) and a question without a cut never call it."""
    vector_width(True)
    model = on_blocks(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    cache = saved(model, Bits(3, 2, share=0.2, sharp=(8, 4)), tmp_path / "cache.snapkv")
    question = ids(QUESTION, 2)
    taken = coded_calls(monkeypatch)
    tokens = list(answer(model, cache, question, per_question=Cut(64, 8), max_new_tokens=8))
    assert taken == [True] * len(model.model.layers)
    taken.clear()
    assert list(answer(model, cache, question, per_question=Cut(64, 8), max_new_tokens=8, engine="torch")) == tokens
    assert list(answer(model, cache, question, per_question=None, max_new_tokens=8))
    assert taken == []
    monkeypatch.setattr(native_question, "attend_coded", lambda *a: None)
    assert list(answer(model, cache, question, per_question=Cut(64, 8), max_new_tokens=8)) == tokens


def test_what_the_coded_path_does_not_read_goes_the_restored_way(tmp_path, vector_width):
    """None (and nothing changed) where the codes are not what the kernel reads: keys and values whose sharper
    positions differ, head_dim not a multiple of 64, the 16-lane functions not in use (by default only the avx512
    build uses them; the others run them in plain C, vectors.h, only on request)."""
    vector_width(True)
    model = on_blocks(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    cache = saved(model, Bits(3, 2, share=0.2, sharp=(8, 4)), tmp_path / "cache.snapkv")
    plan = CompressionPlan(Cut(64, 8), window=QUESTION)
    attention = model.model.layers[0].self_attn
    query, key, value = torch.randn(1, 2, QUESTION, 64), torch.randn(1, 1, QUESTION, 64), torch.randn(1, 1, QUESTION, 64)

    def first_layer(stored_values=None):
        working = WorkingCache.of(cache, model.config, for_question=True)
        layer = working.layers[0]
        if stored_values is not None:
            layer.stored_values = stored_values
        return layer

    assert coded_attention.attend_coded(attention, query, key, value, first_layer(), plan) is not None
    values = first_layer().stored_values
    flipped = values.sharp.clone()
    flipped[0, [int(flipped[0].nonzero()[0]), int((~flipped[0]).nonzero()[0])]] ^= True  # as many, other positions
    restored = cache.values[0]  # (kv_heads, kept, head_dim), restored whole
    other = quantize_mixed(restored, flipped, *[stored_schemes(bits, 64)[1] for bits in (Bits(8, 4), Bits(3, 2))])
    layer = first_layer(other)
    assert coded_attention.attend_coded(attention, query, key, value, layer, plan) is None and not layer.restored
    vector_width(False)  # every build declines then (the restored path is faster than the 16 lanes in plain C)
    layer = first_layer()
    assert coded_attention.attend_coded(attention, query, key, value, layer, plan) is None and not layer.restored
    vector_width(True)
    small = on_blocks(num_attention_heads=4, num_key_value_heads=2)  # head_dim 16
    small_cache = saved(small, Bits(4, 3), tmp_path / "small.snapkv")
    layer = WorkingCache.of(small_cache, small.config, for_question=True).layers[0]
    assert coded_attention.attend_coded(small.model.layers[0].self_attn, torch.randn(1, 4, QUESTION, 16),
                                          torch.randn(1, 2, QUESTION, 16), torch.randn(1, 2, QUESTION, 16), layer,
                                          plan) is None


def test_a_model_without_weight_blocks_takes_the_coded_path_too(tmp_path, monkeypatch, vector_width):
    """A plain fp32 Llama (no 4/8-bit blocks: no C parts around the attention, as a user's own checkpoint on a CPU)
    still attends and cuts each layer from its codes, and answers as with every layer restored (the torch engine)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from conftest import COMMON

    vector_width(True)
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert native_decode.question_layers(model) is None
    cache = saved(model, Bits(3, 2, share=0.2, sharp=(8, 4)), tmp_path / "cache.snapkv")
    question = ids(QUESTION, 2)
    taken = coded_calls(monkeypatch)
    tokens = list(answer(model, cache, question, per_question=Cut(64, 8), max_new_tokens=8))
    assert len(tokens) == 8 and taken == [True] * config.num_hidden_layers
    taken.clear()
    assert list(answer(model, cache, question, per_question=Cut(64, 8), max_new_tokens=8, engine="torch")) == tokens
    assert taken == []


@pytest.mark.parametrize("bits", [Bits(3, 2, share=0.2, sharp=(8, 4)), Bits(4, 3), Bits(8)])
def test_a_layer_still_in_its_codes_restores_only_the_kept_positions_as_the_whole_restore_gives_them(bits, tmp_path,
                                                                                                     monkeypatch):
    """The cut's keep_positions over a layer that holds its codes and the question's rows apart (as attend_coded left
    it): the kept rows the whole layer's restore gives, to the bit (the C kernel's rows), within rounding without the
    kernels (PyTorch's restore); a layer held but never cut is restored whole when the pass ends."""
    from snapkv.compression.scoring import gather_positions
    from snapkv.storage import quantize

    model = on_blocks(hidden_size=128, num_attention_heads=2, num_key_value_heads=2)
    cache = saved(model, bits, tmp_path / "cache.snapkv")
    question_keys, question_values = torch.randn(1, 2, QUESTION, 64), torch.randn(1, 2, QUESTION, 64)
    generator = torch.Generator().manual_seed(7)
    indices = torch.stack([torch.randperm(PROMPT + QUESTION, generator=generator)[:40].sort().values
                           for _ in range(2)]).unsqueeze(0)  # (1, kv_heads, 40), stored positions and the question's
    assert (indices >= PROMPT).any() and (indices < PROMPT).any()
    for index in (0, 1):
        whole = [torch.cat([restored.unsqueeze(0), own], dim=2) for restored, own in
                 ((cache.keys[index], question_keys), (cache.values[index], question_values))]
        layer = WorkingCache.of(cache, model.config, for_question=True).layers[index]
        layer.hold_question(question_keys, question_values)
        assert layer.keys.shape == (1, 2, PROMPT + QUESTION, 64) and not layer.restored
        layer.keep_positions(indices)
        assert layer.restored and layer.question is None
        assert torch.equal(layer.keys, gather_positions(whole[0], indices))
        assert torch.equal(layer.values, gather_positions(whole[1], indices))
        with monkeypatch.context() as patch:  # PyTorch's restore, then the rows gathered
            patch.setattr(quantize.native, "unavailable_reason", lambda: "switched off for this test")
            layer = WorkingCache.of(cache, model.config, for_question=True).layers[index]
            layer.hold_question(question_keys, question_values)
            layer.keep_positions(indices)
            torch.testing.assert_close(layer.keys, gather_positions(whole[0], indices), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer.values, gather_positions(whole[1], indices), rtol=1e-5, atol=1e-5)
    working = WorkingCache.of(cache, model.config, for_question=True)
    working.layers[0].hold_question(question_keys, question_values)
    working.question_done()  # no cut came: the layer is every position, restored
    assert torch.equal(working.layers[0].keys, torch.cat([cache.keys[0].unsqueeze(0), question_keys], dim=2))
