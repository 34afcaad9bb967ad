"""Stored tiers: quantized keys and values, positions chosen after the prefill by probes, the files they make."""

import json

import pytest
import torch

from conftest import VOCAB, build_tiny
from snapkv.modeling.architectures import attention_layers
from snapkv.storage.cachefile import load_cache, read_metadata, save_cache
from snapkv.compression.config import Cut, SnapKVConfig
from snapkv.io.documents import Document
from snapkv.base.errors import CacheFileError
from snapkv.engine.generation import answer, prefill
from snapkv.compression.methods import KeyNorm, Probe, PseudoQuestion, Reconstruction, SnapKV
from snapkv import native
from snapkv.storage import quantize as quantize_module
from snapkv.base.bits import Bits, Form
from snapkv.storage.quantize import CHANNELS, TOKENS, Mixed, Scheme, dequantize, quantize, quantize_mixed, stored_schemes
from snapkv.session import Session
from snapkv.storage.cache import CompressedCache
from snapkv.storage.store import CacheStore
from snapkv.engine.tiers import SHARPENING, keep_best, probe_scores, sharper_positions

DOCUMENT = Document(" ".join(f"Entry {i}: the ferry left pier {i * 7 % 13} at {i % 12 + 1} o'clock." for i in range(30)))


def random_ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ quantization

@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis, group", [(TOKENS, 32), (CHANNELS, 16), (TOKENS, 128)])
def test_quantization_error_is_within_half_a_step(bits, axis, group):
    torch.manual_seed(bits)
    x = torch.randn(3, 77, 16) * torch.linspace(0.1, 8, 16)  # channels of very different ranges
    q = quantize(x, Scheme(bits, axis, group))
    restored = dequantize(q)
    assert restored.shape == x.shape and q.packed.dtype == torch.uint8
    codes_shape, scale_shape = q.scheme.stored_shapes(x.shape)
    assert tuple(q.packed.shape) == codes_shape and tuple(q.scale.shape) == scale_shape
    # every value within half a quantization step of its group (plus fp16 rounding of scale and minimum)
    step = q.scale.float().max()
    assert (restored - x).abs().max() <= step / 2 + 1e-2 * x.abs().max()
    # the codes (the last group padded to full size), plus two fp16 numbers per group
    groups = x.numel() // x.shape[axis] * -(-x.shape[axis] // group)
    assert q.nbytes == groups * (group * bits // 8 + 4)


def test_quantization_packs_every_code_exactly():
    levels = torch.arange(16, dtype=torch.float32).repeat(2, 4, 1)  # (2, 4, 16): each group holds 0..15
    q = quantize(levels, Scheme(4, CHANNELS, 16))
    assert torch.equal(q.scale.float(), torch.ones(2, 4, 1)) and torch.equal(dequantize(q), levels)
    assert q.packed[0, 0, 0].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]  # low nibble first


def test_three_bit_codes_pack_eight_to_three_bytes():
    levels = torch.arange(8, dtype=torch.float32).repeat(2, 3, 2)  # (2, 3, 16): each group 0..7 twice
    q = quantize(levels, Scheme(3, CHANNELS, 16))
    assert torch.equal(dequantize(q), levels) and q.packed.shape[-1] == 6
    # 0..7 little-endian, 3 bits each: 0b111_110_101_100_011_010_001_000 = 0xFAC688
    assert q.packed[0, 0, 0, :3].tolist() == [0x88, 0xC6, 0xFA]


def test_the_rotation_is_undone_and_evens_out_an_outlier_channel():
    """Hadamard-rotated storage restores the same vectors (the rotation is orthonormal and its own inverse) and,
    where one channel holds an outlier, rounds per token with far less error than without the rotation."""
    torch.manual_seed(0)
    x = torch.randn(2, 64, 64)
    x[..., 5] *= 40  # one outlier channel: a per-token group's range is set by it
    plain, rotated = Scheme(4, CHANNELS, 64), Scheme(4, CHANNELS, 64, rotated=True)
    error = {s.rotated: float((dequantize(quantize(x, s)) - x).pow(2).mean()) for s in (plain, rotated)}
    assert error[True] < 0.5 * error[False]
    assert torch.allclose(dequantize(quantize(x, Scheme(8, CHANNELS, 64, rotated=True))), x, atol=0.5)
    assert Scheme.from_dict(rotated.to_dict()) == rotated and Scheme.from_dict(plain.to_dict()) == plain
    with pytest.raises(ValueError, match="rotation"):
        Scheme.from_dict({**rotated.to_dict(), "rotation": "random"})


@pytest.mark.skipif(native.unavailable_reason() is not None, reason=f"no C kernels: {native.unavailable_reason()}")
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rotated", [False, True])
def test_the_c_dequantizer_restores_what_pytorch_does(bits, rotated, monkeypatch):
    """snapkv/native/kernels/dequantize.c gives PyTorch's values: the same bits unrotated, within fp32 rounding
    rotated (its transform sums in another order), for both axes, padded last groups, head_dim 64, 96 (a
    rotation block of 32) and 12 (4), and a Mixed tensor's rows put back in place."""
    torch.manual_seed(bits)
    cases = [(torch.randn(3, 301, 64) * torch.linspace(0.1, 8, 64), ((TOKENS, 128), (TOKENS, 32), (CHANNELS, 64),
                                                                     (CHANNELS, 16))),
             (torch.randn(2, 45, 96), ((TOKENS, 32), (CHANNELS, 96), (CHANNELS, 64))),  # 96 channels: a padded group
             (torch.randn(2, 19, 12), ((TOKENS, 8), (CHANNELS, 8)))]  # a rotation block of 4: the plain loops
    sharp = torch.zeros(3, 301, dtype=torch.bool)
    for head in range(3):
        sharp[head, torch.randperm(301)[:60]] = True
    for x, layouts in cases:
        for axis, group in layouts:
            quantized = quantize(x, Scheme(bits, axis, group, rotated))
            heads, tokens, head_dim = x.shape
            rows = torch.full((heads * tokens, head_dim), float("nan"))
            assert quantize_module._dequantize_natively(quantized, rows, None)  # the kernel takes it
            monkeypatch.setenv(native.SETTING, "off")
            assert not quantize_module._dequantize_natively(quantized, rows, None)
            reference = dequantize(quantized)  # PyTorch's ops
            monkeypatch.delenv(native.SETTING)
            found = dequantize(quantized)
            assert torch.equal(rows.view(x.shape), found)
            if rotated:
                assert torch.allclose(found, reference, rtol=0, atol=1e-6 * float(reference.abs().max()))
            else:
                assert torch.equal(found, reference)
            assert torch.equal(dequantize(quantized, torch.bfloat16), found.bfloat16())  # rounded as PyTorch rounds
    mixed = quantize_mixed(cases[0][0], sharp, Scheme(8, TOKENS, 32), Scheme(bits, CHANNELS, 64, rotated))
    monkeypatch.setenv(native.SETTING, "off")
    reference = dequantize(mixed)
    monkeypatch.delenv(native.SETTING)
    if rotated:
        assert torch.allclose(dequantize(mixed), reference, rtol=0, atol=1e-6 * float(reference.abs().max()))
    else:
        assert torch.equal(dequantize(mixed), reference)


@pytest.mark.skipif(native.unavailable_reason() is not None, reason=f"no C kernels: {native.unavailable_reason()}")
def test_the_c_dequantizer_gives_the_same_bits_with_avx512_as_with_avx2(vector_width):
    """With AVX-512 the inverse rotation of a 64-channel row runs in four 16-float vectors (dequantize.c
    hadamard_64_wide) instead of eight of 8: the same additions, so the same bits, for both axes and into a
    destination with room (snapkv.storage.deferred's buffer)."""
    if not vector_width(True):
        pytest.skip("this CPU lacks AVX-512")
    torch.manual_seed(5)
    x = torch.randn(3, 301, 64) * torch.linspace(0.1, 8, 64)
    for bits in (2, 3, 4, 8):
        for axis, group in ((TOKENS, 128), (CHANNELS, 64)):
            quantized = quantize(x, Scheme(bits, axis, group, rotated=True))
            found = {}
            for wide in (True, False):
                vector_width(wide)
                found[wide] = dequantize(quantized, room=5)
            assert torch.equal(found[True], found[False])


def test_stored_bits_read_as_one_number_or_keys_over_values():
    assert Bits.parse("4/3") == Bits(4, 3) and str(Bits(4, 3)) == "4/3" and Bits(4, 3).to_json() == "4/3"
    assert Bits.parse(8) == 8 and Bits.parse("8") == Bits(8, 8) and Bits(8).to_json() == 8
    assert {Bits(16): "a"}[16] == "a" and Bits(4, 3) != 4
    for bad in ("5", "4/16", "4/3/2", "four", True):
        with pytest.raises(ValueError):
            Bits.parse(bad)
    keys, values = stored_schemes(Bits(4, 3), 64)
    assert (keys.bits, keys.axis, keys.rotated, values.bits, values.axis, values.group) == (4, TOKENS, True, 3, CHANNELS, 64)
    assert not any(s.rotated for s in stored_schemes(Bits(8), 64))  # 8 bits: KIVI's plain groups of 32


def test_stored_bits_take_a_form_per_kind():
    """r/u after a kind's bits chooses its rotation, gN its group size; what is left out keeps the default."""
    rotated = Bits.parse("8r/8")
    assert (rotated.keys, rotated.values, rotated.key_form, rotated.value_form) == (8, 8, Form(True), Form())
    assert str(rotated) == rotated.to_json() == "8r/8" and rotated != 8 and rotated != Bits(8)
    assert str(Bits.parse("4g32/4g32")) == "4g32" and Bits.parse("4ug32/3").key_form == Form(False, 32)
    assert Bits.parse("4/2g32+20%@8/4").rest == Bits.parse("4/2g32") and Bits.parse("8r").describe() == \
        "8r-bit (r: rotated)"
    assert len({Bits.parse("8r/8"), Bits(8, key_form=Form(rotated=True)), Bits(8)}) == 2
    for bad in ("16r/8", "8/16g32", "4g33/4", "8g8192", "8g0", "8x", "8rr", "4/2+20%@8r/4", "g32"):
        with pytest.raises(ValueError):
            Bits.parse(bad)
    keys, values = stored_schemes(Bits.parse("8r/4g32"), 64)
    assert (keys.bits, keys.axis, keys.group, keys.rotated) == (8, TOKENS, 32, True)  # 8 bits' group, rotated
    assert (values.bits, values.axis, values.group, values.rotated) == (4, CHANNELS, 32, True)  # below 8: rotated
    keys, _ = stored_schemes(Bits.parse("4ug64/4"), 64)
    assert (keys.group, keys.rotated) == (64, False)


def test_stored_bits_take_a_sharper_share():
    sharp = Bits.parse("4/2+20%@4")
    assert (sharp.keys, sharp.values, sharp.share, sharp.sharp) == (4, 2, 0.2, (4, 4))
    assert str(sharp) == sharp.to_json() == "4/2+20%@4" and Bits.parse(str(sharp)) == sharp
    assert sharp.rest == Bits(4, 2) and sharp.sharper == 4 and sharp != Bits(4, 2) and sharp != 4
    assert str(Bits.parse("3+10%@8/4")) == "3+10%@8/4" and Bits(8).sharper is None
    assert len({Bits.parse("4/2+20%@4"), Bits(4, 2, share=0.2, sharp=(4, 4)), Bits(4, 2)}) == 2
    for bad, message in [("4/2+0%@4", "1 to 99"), ("4/2+100%@4", "between 1% and 99%"), ("4/2+20@4", "SHARE%@"),
                         ("4/2+2.5%@4", "1 to 99"), ("4+20%@4", "above the rest"), ("4/2+20%@16", "below 16"),
                         ("16+20%@8", "below 16"), ("4/2+20%@5", "must be 16, 8"), ("8/16", "keys in 16 bits too"),
                         ("16/8+20%@16/8", "below 16")]:
        with pytest.raises(ValueError, match=message):
            Bits.parse(bad)


def test_a_mixed_tensor_keeps_its_sharper_share_in_more_bits():
    torch.manual_seed(0)
    x = torch.randn(2, 300, 64)
    sharp = torch.zeros(2, 300, dtype=torch.bool)
    sharp.scatter_(1, torch.rand(2, 300).topk(60, dim=1).indices, True)
    high, low = Scheme(8, CHANNELS, 32), Scheme(2, CHANNELS, 64, rotated=True)
    mixed = quantize_mixed(x, sharp, high, low)
    assert mixed.shape == x.shape and mixed.high.shape == (2, 60, 64) and mixed.low.shape == (2, 240, 64)
    assert mixed.nbytes == mixed.high.nbytes + mixed.low.nbytes + 2 * 38  # the mask at one bit per position
    restored = dequantize(mixed)
    # each part restored in place, exactly as quantizing it alone would
    assert torch.equal(restored[sharp].reshape(2, 60, 64), dequantize(quantize(x[sharp].reshape(2, 60, 64), high)))
    assert torch.equal(restored[~sharp].reshape(2, 240, 64), dequantize(quantize(x[~sharp].reshape(2, 240, 64), low)))
    error = (restored - x).norm(dim=-1) / x.norm(dim=-1)  # (kv_heads, tokens)
    assert error[sharp].max() < 0.05 < error[~sharp].min()
    uneven = sharp.clone()
    uneven[0, (~sharp[0]).nonzero()[0]] = True
    with pytest.raises(ValueError, match="as many"):
        quantize_mixed(x, uneven, high, low)


def test_sharper_positions_are_the_template_and_the_best_scored(tiny_loaded):
    whole = Session(tiny_loaded, SnapKVConfig(store_bits=16)).prepare(DOCUMENT).cache
    chosen = sharper_positions(tiny_loaded.model, tiny_loaded.prompter, whole, 0.3)
    probes = SHARPENING.probes(tiny_loaded.prompter, whole.token_ids, whole.document)
    scores = probe_scores(tiny_loaded.model, whole, SHARPENING, probes)
    document, n = whole.document, whole.original_length
    outside = torch.ones(n, dtype=torch.bool)
    outside[document.start:document.stop] = False
    assert 0.3 * n > outside.sum()  # the share has room for the template and for the document's best
    for layer_chosen, layer_scores in zip(chosen, scores):
        assert layer_chosen.shape == whole.keys[0].shape[:2]
        assert (layer_chosen.sum(dim=1) == round(0.3 * n)).all() and layer_chosen[:, outside].all()
        for head in range(layer_chosen.shape[0]):
            inside = layer_scores[head, document.start:document.stop]
            picked = layer_chosen[head, document.start:document.stop]
            assert inside[picked].min() >= inside[~picked].max()


def test_a_sharper_tier_derived_from_a_whole_file_equals_a_built_one(tiny_loaded):
    settings = SnapKVConfig(budget=32, window=8, store_bits="4/2+20%@8")
    built = Session(tiny_loaded, settings).prepare(DOCUMENT)
    derived = Session(tiny_loaded, settings).derive(Session(tiny_loaded, SnapKVConfig(store_bits=16)).prepare(DOCUMENT))
    assert isinstance(built.cache.payload[0][0], Mixed) and built.cache.tier.bits == Bits.parse("4/2+20%@8")
    for (a_keys, a_values), (b_keys, b_values) in zip(built.cache.payload, derived.cache.payload):
        assert torch.equal(a_keys.sharp, b_keys.sharp) and torch.equal(a_values.sharp, b_values.sharp)
    for a, b in zip(built.cache.keys + built.cache.values, derived.cache.keys + derived.cache.values):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ probes

@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "phi3", "gemma3"])
def test_reconstruction_probe_scores_match_a_plain_reference(name):
    """The score of a cached key is the most attention any probe query of its group pays it, the softmax
    running over the sinks, the scored keys and the probe's own keys: written out plainly from eager weights."""
    model = build_tiny(name, attn_implementation="eager")
    prompt, probe_ids = random_ids(40, 1), random_ids(6, 2)
    whole = prefill(model, prompt, None)
    probe = Probe(probe_ids, scored=range(10, 30), sinks=range(0, 4))
    scores = probe_scores(model, whole, Reconstruction(), [probe])
    subset = list(probe.sinks) + list(probe.scored) + list(range(40, 46))
    with torch.no_grad():
        out = model(torch.cat([prompt, probe_ids]).unsqueeze(0), output_attentions=True)
    for layer in attention_layers(model):
        if not layer.compressible:
            assert torch.isneginf(scores[layer.index]).all()
            continue
        # logits of the probe's queries over the chosen keys, recovered from eager softmax weights: the
        # weights over a subset renormalise to the softmax over that subset
        weights = out.attentions[layer.index][0, :, 40:, :]  # (q_heads, 6, 46)
        picked = weights[:, :, subset]
        picked = picked / picked.sum(dim=-1, keepdim=True)
        kv_heads = model.config.num_key_value_heads
        grouped = picked.view(kv_heads, -1, 6, len(subset))
        expected = grouped.amax(dim=(1, 2))[:, len(probe.sinks):len(probe.sinks) + len(probe.scored)]
        assert torch.allclose(scores[layer.index][:, 10:30], expected, atol=1e-5), layer.index
        assert torch.isneginf(scores[layer.index][:, :10]).all()


def test_probes_leave_the_whole_cache_untouched(tiny_loaded):
    session = Session(tiny_loaded, None)
    whole = session.prepare(DOCUMENT).cache
    before = [t.clone() for t in whole.keys + whole.values]
    probes = Reconstruction(chunk=64).probes(tiny_loaded.prompter, whole.token_ids, whole.document)
    assert len(probes) == -(-len(whole.document) // 64) and probes[0].scored.start == whole.document.start
    probe_scores(tiny_loaded.model, whole, Reconstruction(chunk=64), probes)
    assert all(torch.equal(a, b) for a, b in zip(before, whole.keys + whole.values))


@pytest.mark.parametrize("method", [Reconstruction(chunk=48), PseudoQuestion(), KeyNorm()], ids=lambda m: m.name)
def test_a_stored_tier_keeps_its_budget_the_template_and_the_best(tiny_loaded, method):
    prompter = tiny_loaded.prompter
    session = Session(tiny_loaded, None)
    whole = session.prepare(DOCUMENT).cache
    cut = Cut(None, 8, method, keep=0.25).sized_for(whole.original_length, whole.document)
    around = whole.original_length - len(whole.document)
    assert cut.budget == around + round(0.25 * len(whole.document))
    scores = probe_scores(tiny_loaded.model, whole, method,
                          method.probes(prompter, whole.token_ids, whole.document))
    tiered = keep_best(whole, scores, cut, [range(0, whole.document.start),
                                             range(whole.document.stop, whole.original_length)])
    for index, positions in enumerate(tiered.positions):
        assert positions.shape[1] == cut.budget
        for head in range(positions.shape[0]):
            kept = positions[head]
            assert torch.all(kept[1:] > kept[:-1])
            assert set(range(whole.document.start)) <= set(kept.tolist())  # the template's head
            assert set(range(whole.document.stop, whole.original_length)) <= set(kept.tolist())
            document_kept = [p for p in kept.tolist() if p in whole.document]
            dropped = [p for p in whole.document if p not in document_kept]
            assert scores[index][head][document_kept].min() >= scores[index][head][dropped].max()
        expected = whole.keys[index].gather(1, positions.unsqueeze(-1).expand(-1, -1, whole.keys[index].shape[-1]))
        assert torch.equal(tiered.keys[index], expected)
    if isinstance(method, KeyNorm):  # of the document, the smallest keys are kept
        norms = whole.keys[0][0].float().norm(dim=-1)
        kept = [p for p in tiered.positions[0][0].tolist() if p in whole.document]
        dropped = [p for p in whole.document if p not in kept]
        assert norms[kept].max() <= norms[dropped].min()


def test_derived_tier_equals_a_built_one(tiny_loaded):
    """Cutting a whole cache already at hand gives what a prefill with that tier gives."""
    settings = SnapKVConfig(budget=32, window=8, store_keep=0.5, store_method="reconstruction", store_bits=4)
    built = Session(tiny_loaded, settings).prepare(DOCUMENT)
    whole = Session(tiny_loaded, None).prepare(DOCUMENT)
    memo: dict = {}
    derived = Session(tiny_loaded, settings).derive(whole, scores_memo=memo)
    assert set(memo) == {settings.store_scorer} and isinstance(settings.store_scorer, Reconstruction)
    for a, b in zip(built.cache.keys + built.cache.positions, derived.cache.keys + derived.cache.positions):
        assert torch.equal(a, b)
    assert derived.cache.tier == built.cache.tier and derived.per_question == built.per_question


def _random_cache(source: torch.dtype, key_scale: float) -> CompressedCache:
    generator = torch.Generator().manual_seed(3)
    keys = [(torch.randn(2, 50, 32, generator=generator) * key_scale).to(source) for _ in range(3)]
    values = [torch.randn(2, 50, 32, generator=generator).to(source) for _ in range(3)]
    return CompressedCache(keys, values, [torch.arange(50).expand(2, -1)] * 3, 50, torch.arange(50))


def _same_stored_part(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert all(torch.equal(getattr(a, name), getattr(b, name)) for name in ("packed", "scale", "minimum"))


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("key_scale, bits", [(3.0, 16), (3.0, "16/8"), (3.0, 8), (3.0, "4g32"), (3.0, "8/4"),
                                             (3.0, "3/2"), (20000.0, 16), (20000.0, "16/8")])
def test_rounding_one_layer_at_a_time_stores_what_rounding_the_whole_cache_twice_does(source, key_scale, bits):
    """The prefill's cache (a bf16 prefill's, or fp32) through 16 bits to its stored bits; keys past fp16's range
    (20,000 x a normal sample) are stored in bf16 instead, by both."""
    whole = _random_cache(source, key_scale).to("cpu", torch.float32).at_precision(16).at_precision(bits)
    for room in (0, 16):
        prefilled = _random_cache(source, key_scale)
        layered = prefilled.stored_one_layer_at_a_time(bits, torch.float32, room)
        assert prefilled.keys == [] and prefilled.values == []  # released as it went
        assert layered.tier.bits == whole.tier.bits
        assert layered.deferred == (room > 0 and Bits.parse(bits).values < 16)  # as a loaded file would be
        for stored, expected in zip(layered.payload, whole.payload):
            for part, expected_part in zip(stored, expected):
                _same_stored_part(part, expected_part)
        for found, expected in zip(list(layered.keys) + list(layered.values), whole.keys + whole.values):
            assert found.dtype == torch.float32 and torch.equal(found, expected)
    # rounded whole, held deferred where it can be (a tier derived from a whole cache: nothing restored whole)
    held = _random_cache(source, key_scale).to("cpu", torch.float32).at_precision(16).at_precision(bits,
                                                                                                  question_room=16)
    assert held.deferred == (Bits.parse(bits).values < 16)
    for found, expected in zip(list(held.keys) + list(held.values), whole.keys + whole.values):
        assert torch.equal(found, expected)


def test_a_fresh_prefill_is_held_in_its_stored_bits_as_a_loaded_file_is(tiny_loaded, tmp_path):
    session = Session(tiny_loaded, SnapKVConfig(budget=48, window=8), store=CacheStore(tmp_path))
    built = session.prepare(DOCUMENT)
    assert built.cache.deferred and built.cache.tier.bits == Bits(8)
    reloaded = session.prepare(DOCUMENT)
    assert reloaded.hit and reloaded.cache.deferred
    for question in ("At what time did the ferry of entry 4 leave?", "Which pier did entry 12 leave from?"):
        assert "".join(session.ask(built, question, max_new_tokens=12)) == \
            "".join(session.ask(reloaded, question, max_new_tokens=12))


# ------------------------------------------------------------------------------------------ files

@pytest.mark.parametrize("bits", [16, "16/8", "16/4", 8, 4, 2, "4/3", "4/2+20%@4", "8r/4g32"])
def test_a_tier_answers_the_same_before_saving_and_after_loading(tiny_loaded, tmp_path, bits):
    settings = SnapKVConfig(budget=48, window=8, store_keep=0.5, store_method="reconstruction", store_bits=bits)
    session = Session(tiny_loaded, settings, store=CacheStore(tmp_path))
    built = session.prepare(DOCUMENT)
    assert built.cache.tier.bits == Bits.parse(bits) and built.cache.payload is not None
    reloaded = session.prepare(DOCUMENT)
    assert reloaded.hit
    for a, b in zip(built.cache.keys + built.cache.values + built.cache.positions,
                    reloaded.cache.keys + reloaded.cache.values + reloaded.cache.positions):
        assert torch.equal(a, b)
    question = torch.tensor([11, 12, 13, 14])
    cut = built.per_question
    assert list(answer(tiny_loaded.model, built.cache, question, per_question=cut, max_new_tokens=8)) == \
        list(answer(tiny_loaded.model, reloaded.cache, question, per_question=cut, max_new_tokens=8))
    metadata = read_metadata(built.path)
    formed = Bits.parse(bits).key_form or Bits.parse(bits).value_form
    version = "5.0" if formed else "4.0" if str(bits).startswith("16/") else "3.0" if "%" in str(bits) else "2.0"
    assert metadata["version"] == version and metadata["tier"]["bits"] == bits
    assert (metadata["storage"].get("keys", {}).get("rotation") == "hadamard") == (Bits.parse(bits).keys < 8
                                                                                  or "r" in str(bits))
    assert ("keys" in metadata["storage"]) == (Bits.parse(bits).keys < 16)
    assert ("values" in metadata["storage"]) == (Bits.parse(bits).values < 16)
    assert metadata["tier"]["cut"]["method"] == "reconstruction" and metadata["tier"]["cut"]["keep"] == 0.5
    assert metadata["storage"]["bits"] == bits and metadata["document_span"] == [built.cache.document.start,
                                                                                   built.cache.document.stop]


def test_a_quantized_file_loads_straight_into_bf16(tiny_loaded, tmp_path, monkeypatch):
    """For a bf16 model a saved cache's codes are restored in bf16 directly (the C kernel's rounding, as
    .to(bfloat16) rounds the fp32 values), and with PyTorch's ops the same up to bf16 rounding."""
    session = Session(tiny_loaded, SnapKVConfig(budget=48, window=8, store_bits="3/2+20%@8/4"),
                      store=CacheStore(tmp_path))
    path = session.prepare(DOCUMENT).path
    in_fp32, _ = load_cache(path, dtype=torch.float32)
    in_bf16, _ = load_cache(path, dtype=torch.bfloat16)
    monkeypatch.setenv(native.SETTING, "off")
    by_pytorch, _ = load_cache(path, dtype=torch.bfloat16)
    for fp32, bf16, reference in zip(in_fp32.keys + in_fp32.values, in_bf16.keys + in_bf16.values,
                                     by_pytorch.keys + by_pytorch.values):
        assert bf16.dtype == reference.dtype == torch.bfloat16
        assert torch.equal(bf16, fp32.bfloat16())
        assert torch.allclose(bf16.float(), reference.float(), rtol=2**-7, atol=1e-6)


def test_fewer_bits_make_smaller_files(tiny_loaded, tmp_path):
    sizes = {}
    for bits in (16, "16/8", "16/4", 8, 4, "4/3", "4/2+20%@4", 2):
        session = Session(tiny_loaded, SnapKVConfig(budget=48, window=8, store_keep=None, store_bits=bits),
                          store=CacheStore(tmp_path))
        sizes[bits] = session.prepare(DOCUMENT).file_bytes
    # the KV shrinks with the bits; ids, masks, scales and the header stay
    assert sizes[16] > 1.6 * sizes[8] and sizes[8] > 1.4 * sizes[4] > 1.4 * 1.2 * sizes[2]
    assert sizes[16] > 1.2 * sizes["16/8"] and sizes["16/8"] > 1.1 * sizes["16/4"] > sizes[8]
    assert sizes[4] > sizes["4/3"] > sizes["4/2+20%@4"] > sizes[2]


def test_an_fp32_run_writes_16_bits(tiny_loaded, tmp_path):
    assert tiny_loaded.dtype == torch.float32
    session = Session(tiny_loaded, SnapKVConfig(budget=48, window=8, store_bits=16), store=CacheStore(tmp_path))
    prepared = session.prepare(DOCUMENT)
    from safetensors.torch import load_file

    stored = load_file(str(prepared.path))
    assert {t.dtype for name, t in stored.items() if name.endswith(("keys", "values"))} == {torch.float16}
    assert prepared.cache.keys[0].dtype == torch.float32  # computed in fp32, rounded as stored


def test_format_1_files_are_still_read(tiny_loaded, tmp_path):
    """A file written by snapkv 0.1 (format 1.0: int32 positions, plain tensors) loads and answers."""
    from safetensors.torch import save_file

    from snapkv.storage.cachefile import payload_digest

    cache = prefill(tiny_loaded.model, random_ids(60, 3), Cut(24, 8))
    tensors = {"token_ids": cache.token_ids.to(torch.int32)}
    for index, (keys, values, positions) in enumerate(zip(cache.keys, cache.values, cache.positions)):
        tensors.update({f"layers.{index}.keys": keys, f"layers.{index}.values": values,
                        f"layers.{index}.positions": positions.to(torch.int32)})
    metadata = {"format": "snapkv-cache", "version": "1.0", "model": tiny_loaded.identity, "mode": "document-window",
                "stored": {"budget": 24, "window": 8, "kernel": 15, "pooling": "max"},
                "settings": {"budget": 24, "window": 8, "kernel": 15, "pooling": "max", "query_aware": False},
                "original_length": 60, "num_layers": cache.num_layers, "dtype": "float32", "sources": [],
                "payload_sha256": payload_digest(tensors)}
    path = tmp_path / "old.snapkv"
    save_file(tensors, str(path), metadata={"snapkv": json.dumps(metadata)})
    loaded = Session(tiny_loaded, None).load_file(path)
    assert loaded.tier.cut == Cut(24, 8, SnapKV()) and loaded.mode == "document-window"
    assert all(torch.equal(a, b) for a, b in zip(loaded.cache.keys + loaded.cache.positions,
                                                 cache.keys + cache.positions))
    # saved again, it is written in the current format, at 16 bits
    save_cache(tmp_path / "new.snapkv", loaded.cache)
    assert read_metadata(tmp_path / "new.snapkv")["version"] == "2.0"


def signed(metadata: dict, tensors: dict) -> dict:
    """metadata with every digest of these tensors, as save_cache writes them: a damaged file that passes the digest
    check, so that what is refused is the damage itself."""
    from snapkv.storage.cachefile import payload_signatures

    return {**metadata, **payload_signatures(tensors)}


def test_damaged_quantized_parts_are_refused(tiny_loaded, tmp_path):
    from safetensors.torch import load_file, save_file

    settings = SnapKVConfig(budget=48, window=8, store_keep=0.5, store_bits=4)
    path = Session(tiny_loaded, settings, store=CacheStore(tmp_path)).prepare(DOCUMENT).path
    metadata = read_metadata(path)
    cases = {
        "codes cut short": lambda t: t.__setitem__("layers.1.keys.codes", t["layers.1.keys.codes"][:, :, :1].clone()),
        "scale is NaN": lambda t: t["layers.0.values.scale"].fill_(float("nan")),
        "heads keep different counts": lambda t: t["layers.2.kept"][0].fill_(255),
    }
    messages = {"codes cut short": "do not fit", "scale is NaN": "NaN", "heads keep different counts": "different"}
    for case, damage in cases.items():
        tensors = load_file(str(path))
        damage(tensors)
        bad = tmp_path / "bad.snapkv"
        save_file(tensors, str(bad), metadata={"snapkv": json.dumps(signed(metadata, tensors))})
        with pytest.raises(CacheFileError, match=messages[case]):
            load_cache(bad)


def test_damaged_sharper_parts_are_refused(tiny_loaded, tmp_path):
    from safetensors.torch import load_file, save_file

    settings = SnapKVConfig(budget=48, window=8, store_bits="4/2+20%@4")
    path = Session(tiny_loaded, settings, store=CacheStore(tmp_path)).prepare(DOCUMENT).path
    metadata = read_metadata(path)
    cases = {
        "heads share differently": (lambda t: t["layers.1.values.sharp_mask"][0].fill_(255), "different"),
        "sharp codes cut short": (lambda t: t.__setitem__("layers.0.keys.sharp_codes",
                                                          t["layers.0.keys.sharp_codes"][:, :1].clone()), "do not fit"),
        "sharp scale is infinite": (lambda t: t["layers.2.keys.sharp_scale"].fill_(float("inf")), "infinite"),
        "sharp part missing": (lambda t: t.pop("layers.0.values.sharp_minimum"), "missing"),
    }
    for case, (damage, message) in cases.items():
        tensors = load_file(str(path))
        damage(tensors)
        bad = tmp_path / "bad.snapkv"
        save_file(tensors, str(bad), metadata={"snapkv": json.dumps(signed(metadata, tensors))})
        with pytest.raises(CacheFileError, match=message):
            load_cache(bad)


def test_masks_and_part_rows_read_the_same_in_c_as_in_numpy_and_torch(monkeypatch):
    """A saved mask's positions (snapkv.storage.cachefile) and a Mixed part's destination rows (snapkv.storage.quantize), found by
    snapkv/native/kernels/dequantize.c and without it: the same, for any room; heads keeping different counts refused both
    ways."""
    from snapkv import native
    from snapkv.storage.cachefile import _pack_mask, _unpack_mask
    from snapkv.storage.quantize import Scheme, quantize_mixed

    if native.unavailable_reason() is not None:
        pytest.skip(f"C kernels unavailable: {native.unavailable_reason()}")
    torch.manual_seed(8)
    positions = torch.sort(torch.stack([torch.randperm(203)[:57] for _ in range(3)]), dim=-1).values
    mask = _pack_mask(positions, 203)
    uneven = mask.clone()
    uneven[1, 0] ^= 1
    sharp = torch.zeros(3, 203, dtype=torch.bool).scatter_(1, positions, True)
    mixed = quantize_mixed(torch.randn(3, 203, 16), sharp, Scheme(8, 1, 32, False), Scheme(3, 1, 128, True))
    found = {}
    for off in (True, False):
        with monkeypatch.context() as patch:
            if off:
                patch.setenv(native.SETTING, "off")
            with pytest.raises(ValueError, match="different"):
                _unpack_mask(uneven, 203)
            mixed._destinations.clear()
            stray = mask.clone()
            stray[:, -1] |= 0x80  # a bit past the 203 positions (position 207): not a position
            found[off] = [_unpack_mask(mask, 203), _unpack_mask(stray, 203), *mixed.destination_rows(0),
                          *mixed.destination_rows(5)]
    assert torch.equal(found[True][0], positions) and torch.equal(found[True][1], positions)
    assert all(torch.equal(a, b) for a, b in zip(found[True], found[False]))
    assert found[False][4][:57].tolist() == positions[0].tolist()  # head 0's sharper tokens, room after each head
    assert found[False][4][57:114].tolist() == (positions[1] + 208).tolist()


def test_a_per_question_cut_as_a_share_is_sized_for_each_document(tiny_loaded):
    from snapkv.compression.config import Cut
    from snapkv.compression.methods import Chunks

    session = Session(tiny_loaded, SnapKVConfig(budget=32, window=8))
    for lines in (20, 60):
        prepared = session.prepare(Document(" ".join(f"Line {i} of the ledger holds {i * 3}." for i in range(lines))))
        document = prepared.cache.document
        around = prepared.tokens - len(document)
        shared = prepared.answering_with(Cut(None, 8, Chunks(size=4), keep=0.25))
        assert shared.per_question.budget == around + round(0.25 * len(document))
        assert shared.kept_per_question == shared.per_question.budget < prepared.tokens
        stream = session.ask(shared, "What does line 3 hold?", max_new_tokens=4)
        "".join(stream)
        assert stream.result.new_tokens >= 1 and stream.result.kv_bytes < prepared.cache.kv_bytes  # decoded on the cut


def test_a_cut_that_keeps_words_whole_sees_the_prompts_words(tiny_loaded, monkeypatch):
    """With whole_words, every layer's per-question cut ranks words (word_maxima over the prompt's own word ids, with
    numbers_with_neighbours its phrases; the question's tokens one word each); the file says so; without it, no layer
    does."""
    from snapkv.compression import compress

    seen = []
    real = compress.word_maxima
    monkeypatch.setattr(compress, "word_maxima", lambda scores, words: seen.append(words) or real(scores, words))
    text = " ".join(f"Line {i} of the ledger holds {i * 3}.{i * 7}." for i in range(20))
    for whole_words, numbers in ((True, False), (True, True), (False, False)):
        seen.clear()
        session = Session(tiny_loaded, SnapKVConfig(budget=32, window=8, whole_words=whole_words,
                                                    numbers_with_neighbours=numbers))
        prepared = session.prepare(Document(text))
        stream = session.ask(prepared, "What does line 3 hold?", max_new_tokens=3)
        "".join(stream)
        assert stream.result.new_tokens >= 1 and prepared.per_question.whole_words == whole_words
        if not whole_words:
            assert seen == []
            continue
        assert len(seen) == tiny_loaded.model.config.num_hidden_layers
        prompt_words = session.prompter.word_ids(prepared.cache.token_ids, numbers_with_neighbours=numbers)
        assert prepared.per_question.numbers_with_neighbours == numbers
        if numbers:  # fewer, longer words: each number with its neighbours
            assert int(prompt_words.max()) < int(session.prompter.word_ids(prepared.cache.token_ids).max())
        assert torch.equal(seen[0][0], prompt_words)  # the stored positions' words, then the question's none


# ------------------------------------------------------------------------------------------ simulated tiers

def _rope(held: int, head_dim: int, kv_heads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (kv_heads, held, head_dim) as a Llama rotary embedding makes them at positions 0..held-1."""
    inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(held).float()[:, None] * inverse  # (held, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1).expand(kv_heads, -1, -1)
    return angles.cos(), angles.sin()


def test_a_simulated_tier_puts_back_its_exact_positions_and_outlier_channels_and_rounds_the_rest():
    from snapkv.measure.simulated import Simulation, simulated_layer

    torch.manual_seed(0)
    keys, values = torch.randn(2, 100, 64), torch.randn(2, 100, 64)
    keys[0, :, 5] *= 40  # an outlier channel in head 0
    bits = Bits.parse("8/4g32")
    plain_keys, plain_values = simulated_layer(keys, values, bits, Simulation())
    key_scheme, value_scheme = stored_schemes(bits, 64)
    assert torch.equal(plain_keys, dequantize(quantize(keys, key_scheme)))
    assert torch.equal(plain_values, dequantize(quantize(values, value_scheme)))
    found_keys, found_values = simulated_layer(keys, values, bits, Simulation(sinks=3, recent=10, key_outliers=1))
    for found, exact, plain in ((found_keys, keys, plain_keys), (found_values, values, plain_values)):
        assert torch.equal(found[:, :3], exact[:, :3]) and torch.equal(found[:, -10:], exact[:, -10:])
        assert not torch.equal(found[:, 3:90], exact[:, 3:90])
    assert torch.equal(found_keys[0, :, 5], keys[0, :, 5])  # the outlier channel, exact
    assert torch.equal(found_keys[0, 3:90, :5], plain_keys[0, 3:90, :5])  # the rest as the tier rounds it
    assert torch.equal(found_values[:, 3:90], plain_values[:, 3:90])


def test_keys_rounded_before_rope_come_back_with_rope_on():
    from snapkv.measure.simulated import Simulation, simulated_layer, with_rope, without_rope

    torch.manual_seed(1)
    cos, sin = _rope(120, 64)
    before = torch.randn(2, 120, 64) * 0.1 + torch.linspace(-3, 3, 64)  # each channel near a value of its own
    keys, values = with_rope(before, cos, sin), torch.randn(2, 120, 64)
    torch.testing.assert_close(without_rope(keys, cos, sin), before, rtol=1e-5, atol=1e-5)
    sixteen = simulated_layer(keys, values, Bits(16), Simulation(keys_before_rope=True), (cos, sin))
    torch.testing.assert_close(sixteen[0], keys, rtol=1e-5, atol=1e-5)  # nothing rounded: RoPE off and on again
    bits = Bits.parse("4ug32/8")
    after_rope = simulated_layer(keys, values, bits, Simulation())[0]
    before_rope = simulated_layer(keys, values, bits, Simulation(keys_before_rope=True), (cos, sin))[0]
    # channels alike before RoPE (KVQuant's case) round with a smaller error there than after it
    assert (before_rope - keys).abs().mean() < 0.5 * (after_rope - keys).abs().mean()
    with pytest.raises(ValueError, match="cos and sin"):
        simulated_layer(keys, values, bits, Simulation(keys_before_rope=True))


def test_number_positions_are_digits_and_their_separators_and_a_simulated_tier_keeps_them_exact():
    from snapkv.measure.simulated import Simulation, number_tokens, simulated_layer

    texts = ["The", " revenue", " was", " ", "1", "2", ",", "5", "0", "0", " in", " ", "2", "0", "2", "3", ".", " Up",
             " 4", "%", ", ", "Q", "3", "."]
    found = number_tokens(texts).tolist()
    assert [text for text, chosen in zip(texts, found) if chosen] == ["1", "2", ",", "5", "0", "0", "2", "0", "2", "3",
                                                                     ".", " 4", "%", "3", "."]
    torch.manual_seed(2)
    keys, values = torch.randn(2, 24, 64), torch.randn(2, 24, 64)
    numbers = torch.tensor(found).expand(2, 24)  # (kv_heads, held)
    bits = Bits.parse("4")
    kept_keys, kept_values = simulated_layer(keys, values, bits, Simulation(numbers=True), numbers=numbers)
    plain_keys, plain_values = simulated_layer(keys, values, bits, Simulation())
    for kept, exact, plain in ((kept_keys, keys, plain_keys), (kept_values, values, plain_values)):
        assert torch.equal(kept[numbers], exact[numbers]) and torch.equal(kept[~numbers], plain[~numbers])
    with pytest.raises(ValueError, match="number"):
        simulated_layer(keys, values, bits, Simulation(numbers=True))


def test_a_simulation_of_some_layers_rounds_those_and_says_so():
    from snapkv.measure.simulated import Simulation

    halves = Simulation(layers=(0, 14))
    assert [halves.rounds_layer(index) for index in (0, 14, 15, 29)] == [True, True, False, False]
    assert all(Simulation().rounds_layer(index) for index in range(30))
    assert "only layers 0-14 rounded" in halves.describe() and "layers" not in Simulation().describe()


def test_a_simulated_tier_estimates_its_size_against_16_bits():
    from snapkv.measure.simulated import Simulation, estimated_ratio

    assert estimated_ratio(Bits(8), Simulation(), 6000, 64) == pytest.approx(32 / 18)  # 8 bits and 1 of scale each
    assert estimated_ratio(Bits.parse("8/4g32"), Simulation(), 6000, 64) == pytest.approx(32 / 14)
    with_exact = estimated_ratio(Bits.parse("8/4g32"), Simulation(sinks=4, recent=56), 6000, 64)
    assert with_exact == pytest.approx(32 / (0.01 * 32 + 0.99 * 14))
    assert estimated_ratio(Bits(16), Simulation(), 6000, 64) == 1.0
    with_numbers = estimated_ratio(Bits.parse("8/4g32"), Simulation(sinks=4, recent=56, numbers=True), 6000, 64, 0.09)
    assert with_numbers == pytest.approx(32 / (0.1 * 32 + 0.9 * 14))


def test_entropy_per_value_is_each_components_order_zero_entropy():
    from snapkv.measure.transform_coded import entropy_per_value

    four_levels = torch.arange(400).remainder(4).view(400, 1)  # 0..3 equally often: 2 bits
    constant = torch.full((400, 1), 7)  # one level: 0 bits
    halves = (torch.arange(400) < 200).long().view(400, 1) - 5  # two levels, negative too: 1 bit
    assert entropy_per_value(four_levels) == pytest.approx(2.0)
    assert entropy_per_value(torch.cat([four_levels, constant, halves], dim=1)) == pytest.approx(1.0)


def test_transform_coding_meets_its_rate_and_pca_finds_what_the_channels_hide():
    from snapkv.measure.transform_coded import (_coded_step, entropy_per_value, principal_basis,
                                                transform_coded, transform_coded_head)

    torch.manual_seed(2)
    # a head whose 64 channels all follow one hidden direction, plus a little noise: PCA puts it in one component
    direction = torch.nn.functional.normalize(torch.randn(64), dim=0)
    x = torch.randn(500, 1) * 5 * direction + torch.randn(500, 64) * 0.05 + 1.0
    centred = x - x.mean(dim=0)
    basis = principal_basis(centred)
    torch.testing.assert_close(basis.T @ basis, torch.eye(64), atol=1e-5, rtol=0)  # orthonormal
    assert abs(float(basis[:, 0] @ direction)) > 0.99  # the largest component is the hidden direction
    errors = {}
    for transform in ("pca", "hadamard", "channels"):
        components = {"pca": centred @ basis, "channels": centred}.get(transform)
        if components is not None:  # the step found costs at most the rate, and little less
            step = _coded_step(components, 3.0)
            assert 2.9 < entropy_per_value(torch.round(components / step).long()) <= 3.0
        restored = transform_coded_head(x, 3.0, transform)
        errors[transform] = float((restored - x).pow(2).mean())
        assert errors[transform] < float(centred.pow(2).mean()) * 1e-2
        assert float((transform_coded_head(x, 6.0, transform) - x).pow(2).mean()) < errors[transform] / 16
    assert errors["pca"] < errors["channels"] / 4 and errors["pca"] < errors["hadamard"] / 4
    heads = torch.stack([x, x * 2])  # (kv_heads, held, head_dim): each head coded on its own
    torch.testing.assert_close(transform_coded(heads, 3.0, "pca")[1], transform_coded_head(x * 2, 3.0, "pca"))
    with pytest.raises(ValueError, match="transform is one of"):
        transform_coded_head(x, 3.0, "wavelet")


def test_a_transform_coded_simulation_replaces_the_tiers_rounding_and_counts_what_it_stores_beside():
    from snapkv.measure.simulated import Simulation, estimated_ratio, simulated_layer
    from snapkv.measure.transform_coded import transform_coded

    torch.manual_seed(3)
    keys, values = torch.randn(2, 100, 64), torch.randn(2, 100, 64)
    bits = Bits.parse("4/3")
    coded_keys, coded_values = simulated_layer(keys, values, bits, Simulation(coded="pca"))
    assert torch.equal(coded_keys, transform_coded(keys, 4, "pca"))
    assert torch.equal(coded_values, transform_coded(values, 3, "pca"))
    # per head: its mean, step and a 64 x 64 basis in fp16 beside 4 + 3 bits a value
    side = ((64 + 2) * 16 + 64 * 64 * 16) / (6000 * 64)
    assert estimated_ratio(bits, Simulation(coded="pca"), 6000, 64) == pytest.approx(32 / (7 + 2 * side))
    sixteen = simulated_layer(keys, values, Bits(16), Simulation(coded="channels"))  # 16 bits: as it is
    assert torch.equal(sixteen[0], keys) and torch.equal(sixteen[1], values)
    assert estimated_ratio(Bits(16), Simulation(coded="pca"), 6000, 64) == 1.0
    assert "transform-coded (pca)" in Simulation(coded="pca").describe()
