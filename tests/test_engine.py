"""SnapKV mechanics on tiny random models of every supported architecture."""

import contextlib

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel
from transformers.cache_utils import DynamicLayer

from conftest import VOCAB, build_tiny
from snapkv import native
from snapkv.modeling.architectures import attention_layers
from snapkv.compression.compress import CompressionPlan, compressing
from snapkv.compression.config import Cut, SnapKVConfig
from snapkv.compression.methods import SnapKV
from snapkv.base.errors import UnsupportedModelError
from snapkv.engine.generation import answer, prefill
from snapkv.engine.working_cache import WorkingCache

PROMPT_LENGTH = 96


def random_ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def compressible_indices(model) -> list[int]:
    return [layer.index for layer in attention_layers(model) if layer.compressible]


def assert_caches_equal(a, b) -> None:
    assert a.original_length == b.original_length
    for x, y in zip(a.keys + a.values + a.positions, b.keys + b.values + b.positions):
        assert torch.equal(x, y)


def test_compressed_shapes(tiny_model):
    config = SnapKVConfig(budget=40, window=8, query_aware=False)
    cache = prefill(tiny_model, random_ids(PROMPT_LENGTH, 1), config.stored_tier)
    text = tiny_model.config
    kv_heads = text.num_key_value_heads
    compressible = compressible_indices(tiny_model)
    assert compressible, "every supported model has full-attention layers to compress"
    for index in range(text.num_hidden_layers):
        keys, values, positions = cache.keys[index], cache.values[index], cache.positions[index]
        assert keys.shape == values.shape
        assert keys.shape[0] == kv_heads and positions.shape == keys.shape[:2]
        if index in compressible:
            assert keys.shape[1] == config.budget
        else:  # a sliding-window layer keeps its window's tail, untouched
            assert keys.shape[1] < PROMPT_LENGTH
            assert torch.equal(positions[0], torch.arange(PROMPT_LENGTH - keys.shape[1], PROMPT_LENGTH))
    assert cache.original_length == PROMPT_LENGTH
    assert cache.kv_bytes < cache.full_kv_bytes()


def test_hooks_are_removed(tiny_model):
    modules = [layer.module for layer in attention_layers(tiny_model)]
    before = [len(m._forward_hooks) for m in modules]
    plan = CompressionPlan(Cut(budget=12, window=4, method=SnapKV(kernel=3, pooling="max")), window=4)
    with compressing(tiny_model, plan):
        assert sum(len(m._forward_hooks) for m in modules) == len(compressible_indices(tiny_model))
    assert [len(m._forward_hooks) for m in modules] == before
    with pytest.raises(RuntimeError):
        with compressing(tiny_model, plan):
            raise RuntimeError("interrupted prefill")
    assert [len(m._forward_hooks) for m in modules] == before


def reference_selection(attention: torch.Tensor, kv_heads: int, window: int, budget: int, kernel: int,
                        pooling: str) -> torch.Tensor:
    """SnapKV's choice written out plainly from the eager attention weights of the full prompt.

    attention: (q_heads, n, n) softmax weights. Returns (kv_heads, budget) sorted kept positions.
    """
    q_heads, n, _ = attention.shape
    group = q_heads // kv_heads
    prefix = n - window
    kept = []
    for kv_head in range(kv_heads):
        pooled_per_head = []
        for q_head in range(kv_head * group, (kv_head + 1) * group):
            votes = [sum(float(attention[q_head, row, col]) for row in range(prefix, n)) for col in range(prefix)]
            pooled = []
            for col in range(prefix):
                neighbourhood = [votes[j] if 0 <= j < prefix else None
                                 for j in range(col - kernel // 2, col + kernel // 2 + 1)]
                if pooling == "max":
                    pooled.append(max(v for v in neighbourhood if v is not None))
                else:  # zero padding counts in the average, as in avg_pool1d
                    pooled.append(sum(v or 0.0 for v in neighbourhood) / kernel)
            pooled_per_head.append(pooled)
        mean = [sum(h[col] for h in pooled_per_head) / group for col in range(prefix)]
        best = sorted(range(prefix), key=lambda col: mean[col], reverse=True)[: budget - window]
        kept.append(sorted(best) + list(range(prefix, n)))
    return torch.tensor(kept)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "phi3", "gemma3"])
def test_kept_positions_match_plain_reference(name):
    model = build_tiny(name, attn_implementation="eager")
    ids = random_ids(48, 2)
    window, budget, kernel = 6, 20, 3
    with torch.no_grad():
        attentions = model(ids.unsqueeze(0), output_attentions=True).attentions
    cache = prefill(model, ids, SnapKVConfig(budget=budget, window=window, kernel=kernel, pooling="avg",
                                             query_aware=False).stored_tier)
    for index in compressible_indices(model):
        expected = reference_selection(attentions[index][0], model.config.num_key_value_heads,
                                       window, budget, kernel, "avg")
        assert torch.equal(cache.positions[index], expected), f"layer {index}"


def test_window_always_kept_and_positions_sorted(tiny_model):
    config = SnapKVConfig(budget=24, window=10, kernel=5, pooling="max", query_aware=False)
    cache = prefill(tiny_model, random_ids(PROMPT_LENGTH, 3), config.stored_tier)
    window = torch.arange(PROMPT_LENGTH - config.window, PROMPT_LENGTH)
    for positions in cache.positions:
        for head in positions:
            assert torch.all(head[1:] > head[:-1])
            assert torch.isin(window, head).all()


def test_kept_keys_are_the_top_scoring_ones():
    """With max pooling ties are common, so compare scores: no dropped key outscores a kept one."""
    from snapkv.compression.scoring import mean_over_query_groups, pool_scores

    model = build_tiny("llama-gqa", attn_implementation="eager")
    ids = random_ids(64, 4)
    with torch.no_grad():
        full = prefill(model, ids, None)
        attentions = model(ids.unsqueeze(0), output_attentions=True).attentions
    config = SnapKVConfig(budget=24, window=8, kernel=5, pooling="max", query_aware=False)
    cache = prefill(model, ids, config.stored_tier)
    for index in range(model.config.num_hidden_layers):
        weights = attentions[index][0]  # (q_heads, n, n)
        votes = weights[:, -config.window :, : 64 - config.window].sum(dim=1, keepdim=False).unsqueeze(0)
        scores = mean_over_query_groups(pool_scores(votes, config.kernel, "max"), 2)[0]
        for head in range(2):
            kept = cache.positions[index][head]
            kept_prefix = kept[kept < 64 - config.window]
            dropped = torch.ones(64 - config.window, dtype=torch.bool)
            dropped[kept_prefix] = False
            assert scores[head][kept_prefix].min() >= scores[head][dropped].max() - 1e-6
        # the kept keys are the full cache's keys at those positions, unchanged
        gathered = full.keys[index].gather(1, cache.positions[index].unsqueeze(-1).expand(-1, -1, 16))
        assert torch.equal(gathered, cache.keys[index])


def test_budget_at_least_prompt_matches_full_cache_and_generate(tiny_model):
    ids, question = random_ids(40, 5), random_ids(6, 6)
    full = prefill(tiny_model, ids, None)
    whole = prefill(tiny_model, ids, Cut(budget=64, window=8))
    assert not whole.compressed
    assert_caches_equal(full, whole)
    ours = list(answer(tiny_model, whole, question, max_new_tokens=12))
    per_question = list(answer(tiny_model, full, question, max_new_tokens=12,
                               per_question=Cut(budget=64, window=8)))
    prompt = torch.cat([ids, question]).unsqueeze(0)
    reference = tiny_model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                    attention_mask=torch.ones_like(prompt))[0, prompt.shape[1]:].tolist()
    assert ours == reference
    assert per_question == reference


@pytest.mark.parametrize("query_aware", [False, True])
def test_cache_unchanged_by_answers_and_questions_independent(tiny_model, query_aware):
    config = SnapKVConfig(budget=32, window=8, query_aware=query_aware, store_budget=64 if query_aware else None,
                          store_keep=None, store_method="snapkv")
    cache = prefill(tiny_model, random_ids(PROMPT_LENGTH, 7), config.stored_tier)
    snapshot = type(cache)([k.clone() for k in cache.keys], [v.clone() for v in cache.values],
                           [p.clone() for p in cache.positions], cache.original_length, cache.token_ids)
    per_question = config.per_question
    first, second = random_ids(5, 8), random_ids(7, 9)
    alone_first = list(answer(tiny_model, cache, first, per_question=per_question, max_new_tokens=8))
    assert_caches_equal(cache, snapshot)
    # an answer abandoned half way (an interrupt) leaves the cache as it was too
    stream = answer(tiny_model, cache, second, per_question=per_question, max_new_tokens=8)
    next(stream)
    stream.close()
    assert_caches_equal(cache, snapshot)
    alone_second = list(answer(tiny_model, cache, second, per_question=per_question, max_new_tokens=8))
    again_first = list(answer(tiny_model, cache, first, per_question=per_question, max_new_tokens=8))
    assert again_first == alone_first
    fresh = prefill(tiny_model, random_ids(PROMPT_LENGTH, 7), config.stored_tier)
    assert list(answer(tiny_model, fresh, second, per_question=per_question, max_new_tokens=8)) == alone_second
    assert_caches_equal(cache, snapshot)


def test_query_aware_pass_keeps_the_budget_and_the_question():
    """In query-aware mode each layer is cut to budget-window document positions plus the question."""
    model = build_tiny("llama-gqa")
    config = SnapKVConfig(budget=24, window=8, store_keep=None)
    cache = prefill(model, random_ids(PROMPT_LENGTH, 10), config.stored_tier)
    assert not cache.compressed  # the stored tier is the whole prompt
    question = random_ids(5, 11)
    lengths: dict[int, list[int]] = {}

    def record(module, args, kwargs):  # cache length as each forward starts
        layer = kwargs["cache"].layers[module.layer_idx]
        lengths.setdefault(module.layer_idx, []).append(layer.keys.shape[2] if layer.is_initialized else 0)

    handles = [layer.module.register_forward_pre_hook(record, with_kwargs=True) for layer in attention_layers(model)]
    try:
        list(answer(model, cache, question, per_question=config.per_question, max_new_tokens=2))
    finally:
        for handle in handles:
            handle.remove()
    # the question pass starts on the whole prompt; the first decode step finds the layer cut
    assert set(tuple(v) for v in lengths.values()) == {(PROMPT_LENGTH, config.cut.prefix_keep + question.shape[0])}


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_the_question_pass_scores_from_the_attention_it_computed(name, monkeypatch):
    """In fp32 on CPU the question's attention weights (snapkv.modeling.cpu_attention) serve SnapKV's scoring: no
    layer computes the window's queries again, and every layer keeps what scoring from scratch keeps."""
    from snapkv.compression import compress
    from snapkv.modeling import cpu_attention
    from snapkv.engine.generation import run_forward

    model = build_tiny(name, attn_implementation=cpu_attention.NAME)
    cache = prefill(model, random_ids(PROMPT_LENGTH, 20), None)
    question = random_ids(6, 21)
    positions = torch.arange(PROMPT_LENGTH, PROMPT_LENGTH + 6).unsqueeze(0)
    window_queries, window_attention = compress.window_queries, compress._window_attention

    def question_pass(window: int, reuse: bool):
        """(logits, kept indices per layer, how many layers computed the window's queries again)."""
        recomputed = []
        with monkeypatch.context() as patch:
            patch.setattr(compress, "window_queries", lambda *a: recomputed.append(1) or window_queries(*a))
            if not reuse:
                # what the layer's attention kept is not handed on: the scores come from the window's queries
                patch.setattr(compress, "_window_attention", lambda captured, *rest: window_attention(None, *rest))
            plan = CompressionPlan(Cut(budget=24, window=8), window=window)
            with compressing(model, plan):
                logits = run_forward(model, question.unsqueeze(0), WorkingCache.of(cache, model.config), positions)
        assert not any(hasattr(layer.module, cpu_attention.CAPTURED) for layer in attention_layers(model))
        return logits, plan.kept, len(recomputed)

    layers = len(attention_layers(model))
    for window in (6, 4):  # the whole question, or only its last rows, as the observation window
        reused, scratch = question_pass(window, True), question_pass(window, False)
        assert reused[2] == 0 and scratch[2] == layers and len(reused[1]) == layers
        assert all(torch.equal(reused[1][i], scratch[1][i]) for i in scratch[1])
        assert torch.allclose(reused[0], scratch[0], atol=1e-5)


def test_positions_continue_at_original_length():
    model = build_tiny("llama-gqa")
    cache = prefill(model, random_ids(PROMPT_LENGTH, 12), Cut(budget=24, window=8))
    seen = []
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"][0].tolist()), with_kwargs=True
    )
    try:
        list(answer(model, cache, random_ids(4, 13), max_new_tokens=3))
    finally:
        hook.remove()
    assert seen[0] == [96, 97, 98, 99]
    assert seen[1:] == [[100], [101]]


def test_short_prompts_are_left_whole(tiny_model):
    config = SnapKVConfig(budget=40, window=32, query_aware=False)
    for length in (1, 5, 32, 40):
        cache = prefill(tiny_model, random_ids(length, length), config.stored_tier)
        assert not cache.compressed
        assert cache.original_length == length


def test_unsupported_architecture_is_refused():
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).eval()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        prefill(model, torch.arange(10), Cut(budget=8, window=2))
    with pytest.raises(UnsupportedModelError):
        attention_layers(model)


def test_sampling_is_reproducible_with_a_seed():
    from snapkv.engine.generation import Sampling

    model = build_tiny("llama-gqa")
    cache = prefill(model, random_ids(32, 14), None)
    sampling = Sampling(temperature=1.0, top_p=0.9, seed=3)
    first = list(answer(model, cache, random_ids(4, 15), sampling=sampling, max_new_tokens=10))
    second = list(answer(model, cache, random_ids(4, 15), sampling=sampling, max_new_tokens=10))
    assert first == second and len(first) == 10


@pytest.mark.parametrize("per_question", [None, Cut(24, 8)])
def test_presized_decoding_answers_token_for_token_as_concatenation(tiny_model, per_question, monkeypatch):
    """The cache written in place (snapkv.modeling.presized) gives the same greedy answer as appending by concatenation,
    on every architecture, the full cache and a per-question cut alike; the stored cache is left unchanged."""
    from snapkv.engine import working_cache

    cache = prefill(tiny_model, random_ids(PROMPT_LENGTH, 5), None)
    before = [keys.clone() for keys in cache.keys]
    question = random_ids(6, 6)
    answers = {}
    for presized in (True, False):
        monkeypatch.setattr(working_cache, "presize_pays", lambda *_: presized)
        answers[presized] = list(answer(tiny_model, cache, question, per_question=per_question, max_new_tokens=24))
    assert len(answers[True]) == 24 and answers[True] == answers[False]
    assert len(set(answers[True])) > 3  # an answer that says something, not one token repeated
    assert all(torch.equal(a, b) for a, b in zip(before, cache.keys))


def test_presized_layer_grows_past_its_room():
    from snapkv.modeling.presized import PresizedLayer

    keys = torch.randn(1, 2, 5, 4)
    layer = PresizedLayer(keys, keys.clone(), room=1)
    for step in range(4):  # the second append goes past the room: the buffer grows, nothing is lost
        new = torch.full((1, 2, 1, 4), float(step))
        layer.update(new, new)
    assert layer.get_seq_length() == 9
    assert torch.equal(layer.keys[:, :, :5], keys)
    assert torch.equal(layer.keys[:, :, 5:, 0], torch.arange(4.0).expand(1, 2, 4))


@pytest.mark.parametrize("per_question", [Cut(budget=24, window=8), None])
def test_a_deferred_cache_answers_as_one_restored_at_load(tiny_model, per_question, tmp_path):
    """A cache loaded deferred (snapkv.storage.cachefile's question_room) keeps its codes; each question's pass restores
    the layers one at a time into one buffer and writes the question into the buffer's room
    (deferred.RestoringLayer). The answers are the same, token for token, as from the same file restored at load,
    for two questions in turn, and the cache holds its codes only, unchanged."""
    from snapkv.storage import deferred
    from snapkv.storage.cachefile import load_cache, save_cache

    stored = prefill(tiny_model, random_ids(PROMPT_LENGTH, 30), None).at_precision(4)
    save_cache(tmp_path / "cache.snapkv", stored)
    lazy, _ = load_cache(tmp_path / "cache.snapkv", question_room=16)
    eager, _ = load_cache(tmp_path / "cache.snapkv")
    assert lazy.deferred and not eager.deferred and lazy.question_room == 16 and eager.question_room == 0
    assert lazy.kept_tokens == eager.kept_tokens and lazy.kv_bytes == eager.kv_bytes
    assert lazy.layer_shapes() == eager.layer_shapes() and lazy.full_kv_bytes(2) == eager.full_kv_bytes(2)
    lent = []
    lend = deferred.RestoreBuffer.lend
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deferred.RestoreBuffer, "lend", lambda self, layer: lent.append(self) or lend(self, layer))
        for seed in (31, 32):  # two questions: the second restores every layer again
            question = random_ids(6, seed)
            answers = [list(answer(tiny_model, cache, question, per_question=per_question, max_new_tokens=12))
                       for cache in (lazy, eager)]
            assert len(answers[0]) == 12 and answers[0] == answers[1]
    plain = [type(layer) is DynamicLayer for layer in DynamicCache(config=tiny_model.config).layers]
    full = sum(plain)  # sliding-window layers (gemma3) are restored on their own, once, and kept
    assert full and len(lent) == 2 * full and len({id(buffer) for buffer in lent[:full]}) == 1  # one buffer per pass
    assert all((restored is None) == is_plain for restored, is_plain in zip(lazy.keys._restored, plain))
    assert all(torch.equal(a, b) for a, b in zip(lazy.keys + lazy.values, eager.keys + eager.values))  # read: restored


def test_a_restoring_layer_writes_into_the_room_or_concatenates_and_copies_out_what_was_not_cut():
    """RestoringLayer restores into the shared buffer and writes a question that fits the room there; a longer one,
    or a second update, is concatenated; a layer still in the buffer is copied out when the next layer takes the
    buffer and when released, so what it holds never changes."""
    from snapkv.storage.deferred import RestoringLayer, StoredLayers, release_buffers, restoring_layers
    from snapkv.storage.quantize import dequantize, quantize, stored_schemes
    from snapkv.base.bits import Bits

    schemes = stored_schemes(Bits.parse(4), 16)
    originals = [torch.randn(2, 9, 16) for _ in range(4)]  # two layers' keys and values
    parts = [quantize(x, scheme) for x, scheme in zip(originals, schemes * 2)]
    keys, values = StoredLayers(parts[0::2], torch.float32), StoredLayers(parts[1::2], torch.float32)
    first, second = restoring_layers(keys, values, room=3)
    assert first.buffer is second.buffer and first.get_seq_length() == 9 and first.keys.shape == (1, 2, 9, 16)
    new = torch.ones(1, 2, 2, 16)
    held_keys, held_values = first.update(new, 2 * new)
    assert first.buffer.holds(held_keys) and held_keys.shape == (1, 2, 11, 16)
    assert torch.equal(held_keys[0, :, :9], dequantize(parts[0])) and torch.equal(held_values[0, :, 9:], 2 * new[0])
    snapshot = held_keys.clone()
    second.update(torch.ones(1, 2, 4, 16), torch.ones(1, 2, 4, 16))  # past the room: concatenated
    assert not first.buffer.holds(first.keys) and torch.equal(first.keys, snapshot)  # copied out first
    assert not second.buffer.holds(second.keys) and second.keys.shape == (1, 2, 13, 16)
    assert torch.equal(second.keys[0, :, :9], dequantize(parts[2]))
    grown, _ = first.update(new, new)  # a second update concatenates onto what it holds
    assert grown.shape == (1, 2, 13, 16)
    cache = DynamicCache()
    cache.layers = [first, second]
    release_buffers(cache)
    assert all(type(layer) is DynamicLayer for layer in cache.layers) and torch.equal(cache.layers[0].keys, grown)
    third = RestoringLayer(parts[0], parts[1], first.buffer, torch.float32)
    third.update(new, new)
    cache.layers = [third]
    release_buffers(cache)  # not cut: released with its own copy
    assert not first.buffer.holds(cache.layers[0].keys) and torch.equal(cache.layers[0].keys[0, :, 9:], new[0])


def test_a_working_cache_leaves_its_compressed_cache_as_it_was_through_an_answers_steps(tiny_model, tmp_path):
    """WorkingCache.of a deferred cache for a question: its full-attention layers still stored until the question's
    pass reaches them (still_stored), tensors of their own once the question is done, room made for the answer where
    it pays, rows held from elsewhere as plain layers; an eager cache's layers are its own tensors, not copies. The
    CompressedCache is unchanged throughout."""
    from snapkv.engine.engines import run_forward
    from snapkv.modeling.presized import PresizedLayer
    from snapkv.storage.cachefile import load_cache, save_cache
    from snapkv.storage.deferred import RestoringLayer

    save_cache(tmp_path / "cache.snapkv", prefill(tiny_model, random_ids(PROMPT_LENGTH, 30), None).at_precision(8))
    lazy, _ = load_cache(tmp_path / "cache.snapkv", question_room=16)
    eager, _ = load_cache(tmp_path / "cache.snapkv")
    plain = [type(layer) is DynamicLayer for layer in DynamicCache(config=tiny_model.config).layers]
    working = WorkingCache.of(lazy, tiny_model.config, for_question=True)
    assert [working.still_stored(index) is not None for index in range(lazy.num_layers)] == plain
    question = random_ids(6, 31)
    run_forward(tiny_model, question.unsqueeze(0), working,
                torch.arange(PROMPT_LENGTH, PROMPT_LENGTH + 6).unsqueeze(0))
    assert all(working.still_stored(index) is None for index in range(lazy.num_layers))  # each restored by the pass
    working.question_done()
    assert not any(isinstance(layer, RestoringLayer) for layer in working.layers)  # the shared buffer let go
    assert all(layer.get_seq_length() == PROMPT_LENGTH + 6 for layer, full in zip(working.layers, plain) if full)
    working.make_room(tiny_model, 4)
    assert all((type(layer) is PresizedLayer) == full for layer, full in zip(working.layers, plain))  # fp32: it pays
    keys = torch.zeros(1, *lazy.layer_shapes()[0][:1], 3, lazy.layer_shapes()[0][2])
    working.hold(0, keys, keys)
    assert type(working.layers[0]) is DynamicLayer and working.layers[0].keys is keys
    assert lazy.deferred and all(restored is None for restored, full in zip(lazy.keys._restored, plain) if full)
    eager_working = WorkingCache.of(eager, tiny_model.config)
    assert all(layer.keys.data_ptr() == kept.data_ptr()
               for layer, kept, full in zip(eager_working.layers, eager.keys, plain) if full)
    assert all(eager_working.still_stored(index) is None for index in range(eager.num_layers))


@pytest.mark.slow
def test_compiled_decoding_answers_token_for_token_as_eager():
    """torch.compile'd steps over a static copy of the cache (snapkv.engine.compiled) give the greedy answer of the eager
    engine, for the full cache and a per-question cut; a second answer of the same room compiles nothing."""
    from snapkv.engine.compiled import decoder_for

    model = build_tiny("llama-gqa")
    cache = prefill(model, random_ids(PROMPT_LENGTH, 5), None)
    question = random_ids(6, 6)
    decoder = decoder_for(model)
    for per_question in (None, Cut(24, 8)):
        eager = list(answer(model, cache, question, per_question=per_question, max_new_tokens=16))
        compiled = list(answer(model, cache, question, per_question=per_question, max_new_tokens=16, engine="compiled"))
        assert decoder.failure is None and compiled == eager and len(set(eager)) > 3
    compiled_once = decoder.compile_seconds
    assert compiled_once > 0
    list(answer(model, cache, question, per_question=Cut(24, 8), max_new_tokens=16, engine="compiled"))
    assert decoder.compile_seconds == compiled_once


def test_a_compiler_failure_falls_back_to_the_eager_step(monkeypatch):
    from snapkv.engine.compiled import decoder_for

    def broken_compile(function, **options):
        def fails(*args):
            raise RuntimeError("no C compiler found\nmore detail")
        return fails

    monkeypatch.setattr(torch, "compile", broken_compile)
    model = build_tiny("qwen2")
    cache = prefill(model, random_ids(PROMPT_LENGTH, 5), None)
    question = random_ids(6, 6)
    decoder = decoder_for(model)
    eager = list(answer(model, cache, question, max_new_tokens=12))
    assert list(answer(model, cache, question, max_new_tokens=12, engine="compiled")) == eager
    assert decoder.failure == "RuntimeError: no C compiler found"
    assert not decoder.qualifies(WorkingCache.of(cache, model.config))  # given up for good


def test_sliding_window_caches_do_not_qualify_for_compiling():
    from snapkv.engine.compiled import CompiledDecoder

    model = build_tiny("gemma3")
    cache = prefill(model, random_ids(PROMPT_LENGTH, 5), None)
    assert not CompiledDecoder(model).qualifies(WorkingCache.of(cache, model.config))
    llama = build_tiny("llama-gqa")
    assert CompiledDecoder(llama).qualifies(WorkingCache.of(prefill(llama, random_ids(PROMPT_LENGTH, 5), None), llama.config))


def test_chunked_prefill_with_nothing_to_drop_is_the_exact_prefill(tiny_model):
    """Chunks that attend to the cache so far and to themselves give the cache of one pass (masks and RoPE
    positions right), on every architecture."""
    from snapkv.engine.generation import chunked_prefill

    ids = random_ids(300, 7)
    exact = prefill(tiny_model, ids, None)
    chunked = chunked_prefill(tiny_model, ids, Cut(1000, 8), chunk=64)
    for index, (a, b) in enumerate(zip(exact.keys + exact.values, chunked.keys + chunked.values)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4), index
    assert all(torch.equal(a, b) for a, b in zip(exact.positions, chunked.positions))


def test_chunked_prefill_stays_within_its_bound_and_one_chunk_is_the_exact_cut(tiny_model):
    from snapkv.engine.generation import chunked_prefill

    ids = random_ids(300, 8)
    cut = Cut(64, 8)
    exact = prefill(tiny_model, ids, cut)
    assert all(torch.equal(a, b) for a, b in zip(exact.positions, chunked_prefill(tiny_model, ids, cut, 512).positions))
    seen = []
    chunked = chunked_prefill(tiny_model, ids, cut, chunk=100, on_chunk=lambda done, total: seen.append((done, total)))
    assert seen == [(100, 300), (200, 300), (300, 300)]
    compressible = set(compressible_indices(tiny_model))
    for index, positions in enumerate(chunked.positions):
        for head in positions:
            assert torch.all(head[1:] > head[:-1])
            assert torch.isin(torch.arange(300 - 8, 300), head).all()  # the prompt's tail: the last window
        if index in compressible:
            assert positions.shape[1] == 64
    assert chunked.original_length == 300


def test_a_last_piece_shorter_than_the_window_joins_the_chunk_before_it():
    from snapkv.engine.generation import chunked_prefill

    model = build_tiny("llama-gqa")
    seen = []
    cache = chunked_prefill(model, random_ids(305, 9), Cut(64, 8), chunk=100,
                            on_chunk=lambda done, total: seen.append(done))
    assert seen == [100, 200, 305]  # 5 tokens left: not a chunk of their own
    assert all(positions.shape[1] == 64 and all(torch.isin(torch.arange(297, 305), head).all() for head in positions)
               for positions in cache.positions)


def test_cpu_decode_attention_matches_sdpa_and_handles_masks(monkeypatch):
    """One query row in bf16 on CPU, or a question's rows in bf16 or fp32, are computed by plain matmuls
    (snapkv.modeling.cpu_attention), grouped heads and masks as sdpa treats them; anything else (one fp32 row
    included) goes to sdpa itself."""
    from transformers.integrations import sdpa_attention

    from snapkv.modeling import cpu_attention

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    query, key, value = torch.randn(1, 6, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    allowed = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    allowed[..., :7] = False  # a sliding window's row: the first positions masked
    # a question's few rows with their causal mask (the rows' own keys last)
    rows = torch.randn(1, 6, 5, 16)
    causal = torch.ones(5, 40, dtype=torch.bool).tril(diagonal=35).expand(1, 1, 5, 40)
    cases = [(query, mask) for mask in (None, allowed, torch.zeros(1, 1, 1, 40).masked_fill(~allowed, float("-inf")))]
    windowed = causal & allowed  # the rows' first positions masked too: the whole mask applies
    cases += [(rows, mask) for mask in (causal, torch.zeros(1, 1, 5, 40).masked_fill(~causal, float("-inf")),
                                        windowed, torch.zeros(1, 1, 5, 40).masked_fill(~windowed, float("-inf")))]
    for queries, mask in cases:  # boolean or additive masks
        expected, _ = sdpa_attention.sdpa_attention_forward(module, queries, key, value, mask, scaling=0.25)
        calls = []
        monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1))
        found, _ = cpu_attention.attention_forward(module, *(t.bfloat16() for t in (queries, key, value)), mask,
                                                   scaling=0.25)
        monkeypatch.undo()
        assert not calls and found.shape == expected.shape == (1, queries.shape[2], 6, 16)
        assert torch.allclose(found.float(), expected, atol=0.03)
        if queries.shape[2] > 1:  # a question's rows in fp32 take the matmuls too, and agree to fp32 rounding
            monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1))
            found, _ = cpu_attention.attention_forward(module, queries, key, value, mask, scaling=0.25)
            monkeypatch.undo()
            assert not calls and torch.allclose(found, expected, atol=1e-5)
    # several rows without a mask (sdpa's own causal flag), more than SHORT_QUERY rows, or fp32: sdpa's kernel
    long_rows = torch.randn(1, 6, cpu_attention.SHORT_QUERY + 1, 16)
    long_mask = torch.ones(1, 1, long_rows.shape[2], 40, dtype=torch.bool)
    for args in ((query.expand(1, 6, 3, 16), key, value, None), (long_rows, key, value, long_mask),
                 (query, key, value, None)):
        calls = []
        monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or (None, None))
        *tensors, mask = args
        cpu_attention.attention_forward(module, *(t.bfloat16() if args[0].shape[2] > 1 else t for t in tensors), mask)
        monkeypatch.undo()
        assert calls == [1]


@pytest.mark.parametrize("kv_heads, group, earlier, rows", [(3, 3, 700, 300), (2, 2, 65, 66), (1, 4, 1, 100)])
def test_a_prompt_block_after_its_cache_is_sdpas_result_from_two_unmasked_calls(kv_heads, group, earlier, rows,
                                                                                 monkeypatch):
    """A prompt's block in fp32 after the cache it extends (a chunk of a chunked prefill, a prompt after its saved
    prefix) is attended without its mask: the earlier keys and the block's own keys (causally) apart, joined by their
    log-sum-exps; sdpa's result to fp32 rounding. Any other mask, bf16, autocast or a batch goes to sdpa."""
    from transformers.integrations import sdpa_attention

    from snapkv.modeling import cpu_attention

    torch.manual_seed(rows)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = group, True
    query = torch.randn(1, kv_heads * group, rows, 32)
    key, value = torch.randn(1, kv_heads, earlier + rows, 32) * 2, torch.randn(1, kv_heads, earlier + rows, 32)
    causal = torch.ones(rows, earlier + rows, dtype=torch.bool).tril(diagonal=earlier).expand(1, 1, -1, -1)
    additive = torch.zeros(1, 1, rows, earlier + rows).masked_fill(~causal, torch.finfo(torch.float32).min)
    for mask in (causal, additive):
        expected, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.2)
        calls = []
        monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1))
        found, _ = cpu_attention.attention_forward(module, query, key, value, mask, scaling=0.2)
        monkeypatch.undo()
        assert not calls and found.shape == expected.shape == (1, rows, kv_heads * group, 32)
        assert torch.allclose(found, expected, atol=2e-6, rtol=1e-5)
    # not a block after its cache, or not plain fp32: sdpa itself
    sliding = causal & torch.ones(rows, earlier + rows, dtype=torch.bool).triu(diagonal=-5)  # earliest keys masked
    padded = causal.clone()
    padded[..., -1] = False  # the block's last key masked for every row
    cases = [(query, key, value, sliding), (query, key, value, padded),
             (query.bfloat16(), key.bfloat16(), value.bfloat16(), causal),
             (query.expand(2, -1, -1, -1), key.expand(2, -1, -1, -1), value.expand(2, -1, -1, -1),
              causal.expand(2, -1, -1, -1))]
    for *tensors, mask in cases:
        calls = []
        monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or (None, None))
        cpu_attention.attention_forward(module, *tensors, mask, scaling=0.2)
        monkeypatch.undo()
        assert calls == [1]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # sdpa computes in bf16 there
        monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(2) or (None, None))
        cpu_attention.attention_forward(module, query, key, value, causal, scaling=0.2)
        monkeypatch.undo()
    assert calls == [1, 2]
    short = cpu_attention.SHORT_QUERY  # a question's few rows: the matmuls or the C kernel, not this path
    assert not cpu_attention._block_after_prefix(query[:, :, -short:], key[:, :, -short - 3:],
                                                 value[:, :, -short - 3:], causal[..., -short:, -short - 3:], 0.0, {})


@pytest.mark.skipif(native.unavailable_reason() is not None, reason=f"no C kernels: {native.unavailable_reason()}")
@pytest.mark.parametrize("kv_heads, group, rows, keys, head_dim", [(3, 3, 18, 517, 64), (2, 4, 7, 100, 128),
                                                                   (1, 1, 2, 33, 16), (4, 2, 13, 16, 32)])
def test_a_questions_fp32_rows_take_the_c_kernel_and_agree_with_the_matmuls(kv_heads, group, rows, keys, head_dim,
                                                                           monkeypatch):
    """fp32 question rows go to snapkv/native/kernels/few_rows.c where every row attends to all the earlier keys: the
    output and the kept weights agree with PyTorch's matmuls to fp32 rounding, for any number of rows and keys (tiles
    of 6 rows and 16 keys with remainders), head sizes and groups, boolean or additive masks, strided caches (a
    RoomLayer's view); earlier keys masked, or the kernels turned off, take the matmuls. The kernel also sums each
    query head's weights over the window's rows (the last ones), as PyTorch sums them."""
    from snapkv.modeling import cpu_attention

    torch.manual_seed(rows)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = group, True
    window = max(1, rows - 3)
    setattr(module, cpu_attention.CAPTURE, window)
    query = torch.randn(1, kv_heads * group, rows, head_dim)
    buffer = torch.randn(2, 1, kv_heads, keys + 5, head_dim)  # 5 free rows after each head's keys
    key, value = buffer[0, :, :, :keys], buffer[1, :, :, :keys]
    causal = torch.ones(rows, keys, dtype=torch.bool).tril(diagonal=keys - rows).expand(1, 1, rows, keys)
    gappy = causal.clone()
    gappy[..., -1, -2] = False  # a hole among the question's own columns: still the kernel's
    masked_early = causal.clone()
    masked_early[..., 0, 2] = False  # an earlier key masked: the matmuls
    by_matmuls = cpu_attention._attend_by_matmuls
    for mask, natively in ((causal, True), (torch.zeros(1, 1, rows, keys).masked_fill(~causal, float("-inf")), True),
                           (gappy, True), (masked_early, False)):
        for turned_off in (False, True):
            calls = []
            with monkeypatch.context() as patch:
                patch.setattr(cpu_attention, "_attend_by_matmuls", lambda *a: calls.append(1) or by_matmuls(*a))
                if turned_off:
                    patch.setenv(native.SETTING, "off")
                found, _ = cpu_attention.attention_forward(module, query, key, value, mask, scaling=head_dim**-0.5)
                captured = module.__dict__.pop(cpu_attention.CAPTURED)
            assert calls == ([] if natively and not turned_off else [1])
            expected, weights = by_matmuls(query, key, value, mask, head_dim**-0.5)
            expected = expected.view(1, kv_heads * group, rows, head_dim).transpose(1, 2)
            assert torch.allclose(found, expected, atol=2e-6, rtol=1e-5)
            assert captured.window == window
            weights = weights.view(1, kv_heads, group, rows, keys)
            assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)
            if natively and not turned_off:  # the kernel keeps the window's sums only
                assert captured.weights is None
                assert torch.allclose(captured.window_sums, weights[..., -window:, :].sum(-2), atol=1e-7, rtol=1e-5)
            else:
                assert torch.equal(captured.weights, weights) and captured.window_sums is None


@pytest.mark.skipif(native.unavailable_reason() is not None, reason=f"no C kernels: {native.unavailable_reason()}")
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_a_questions_c_kernels_give_the_same_bits_with_avx512_as_with_avx2(vector_width, head_dim):
    """few_rows.c's register tile is 6 rows x 64 columns of AVX-512 vectors where the CPU has it (a head's channels
    past the last whole 64 in 6 x 16), else 6 rows x 16 columns of AVX2 vectors: the same sums in the same order, so
    the attention, its kept weights and the linear product are bit for bit the same either way (keys, channels and
    outputs that leave a part-filled tile)."""
    if not vector_width(True):
        pytest.skip("this CPU lacks AVX-512")
    from snapkv.modeling import cpu_attention
    from snapkv.modeling.block_weights import few_rows_matmul

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    setattr(module, cpu_attention.CAPTURE, 11)
    rows, keys = 19, 203  # tiles of 6 rows and 64 (or 16) keys, each with a remainder
    query = torch.randn(1, 6, rows, head_dim)
    key, value = torch.randn(1, 2, keys, head_dim), torch.randn(1, 2, keys, head_dim)
    causal = torch.ones(rows, keys, dtype=torch.bool).tril(diagonal=keys - rows).expand(1, 1, rows, keys)
    x, weight = torch.randn(rows, 200), torch.randn(77, 200)
    found = {}
    for wide in (True, False):
        assert vector_width(wide) == wide
        output, _ = cpu_attention.attention_forward(module, query, key, value, causal, scaling=head_dim**-0.5)
        captured = module.__dict__.pop(cpu_attention.CAPTURED)
        assert captured.weights is None
        found[wide] = (output, captured.window_sums, few_rows_matmul(x, weight))
    for wide_part, narrow_part in zip(found[True], found[False]):
        assert torch.equal(wide_part, narrow_part)
    assert torch.allclose(found[True][2], x @ weight.T, atol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "gemma3"])
def test_a_bf16_model_decodes_with_cpu_attention_as_with_sdpa(name, monkeypatch):
    """The same model in bf16 with snapkv's CPU decode attention and with sdpa: every decoded step's logits
    agree within bf16 rounding (sliding-window layers and per-question cuts included)."""
    from snapkv.modeling import cpu_attention
    from snapkv.engine.generation import run_forward

    models = {impl: build_tiny(name, attn_implementation=impl).to(torch.bfloat16)
              for impl in ("sdpa", cpu_attention.NAME)}
    cache = prefill(models["sdpa"], random_ids(PROMPT_LENGTH, 5), None)
    tokens = list(answer(models["sdpa"], cache, random_ids(6, 6), per_question=Cut(24, 8), max_new_tokens=6))
    fallbacks = []
    sdpa = cpu_attention.sdpa_attention_forward
    monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", lambda *a, **k: fallbacks.append(1) or sdpa(*a, **k))
    question = random_ids(6, 6)
    for impl, model in models.items():
        working = WorkingCache.of(cache, model.config)
        # the question's rows over the prompt's cache, then one decoded token at a time
        logits = [run_forward(model, question.unsqueeze(0), working,
                              torch.arange(PROMPT_LENGTH, PROMPT_LENGTH + 6).unsqueeze(0)).float()]
        for step, token in enumerate(tokens):
            position = torch.tensor([[PROMPT_LENGTH + 6 + step]])
            logits.append(run_forward(model, torch.tensor([[token]]), working, position).float())
        models[impl] = torch.stack(logits)
    assert not fallbacks  # the question and every decoded step of the snapkv model took the matmul path
    difference = (models["sdpa"] - models[cpu_attention.NAME]).abs().max()
    assert difference < 0.05 * models["sdpa"].abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama-gqa", "mistral", "qwen2", "qwen3"])
def test_lean_decode_step_is_the_models_forward_to_the_bit(name, dtype, monkeypatch):
    """snapkv.engine.lean_decode writes out one token's forward for plain Llama-family models: the same logits, bit for
    bit, as the model's own forward, and answer() uses it for every decoded token (full cache and a cut)."""
    from snapkv.modeling import cpu_attention
    from snapkv.engine import lean_decode
    from snapkv.engine.generation import run_forward

    model = build_tiny(name, attn_implementation="sdpa" if dtype == torch.float32 else cpu_attention.NAME)
    model = model.to(dtype)
    cache = prefill(model, random_ids(PROMPT_LENGTH, 5), None)
    question = random_ids(6, 6)
    forward, lean = WorkingCache.of(cache, model.config), WorkingCache.of(cache, model.config)
    assert lean_decode.qualifies(model, lean)
    positions = torch.arange(PROMPT_LENGTH, PROMPT_LENGTH + 6).unsqueeze(0)
    for working in (forward, lean):
        run_forward(model, question.unsqueeze(0), working, positions)
    for step, token in enumerate([5, 17, 99]):
        position = PROMPT_LENGTH + 6 + step
        expected = run_forward(model, torch.tensor([[token]]), forward, torch.tensor([[position]]))
        assert torch.equal(lean_decode.decode_step(model, token, position, lean), expected)
    steps = []
    real_step = lean_decode.decode_step
    monkeypatch.setattr(lean_decode, "decode_step", lambda *a: steps.append(1) or real_step(*a))
    for cut in (None, Cut(24, 8)):
        tokens = list(answer(model, cache, question, per_question=cut, max_new_tokens=12, engine="reference"))
        steps.clear()
        assert list(answer(model, cache, question, per_question=cut, max_new_tokens=12)) == tokens
        assert len(steps) == len(tokens) - 1  # every token after the first (which the question pass gives)


@pytest.mark.parametrize("rows, heads, head_dim", [(1, 1, 2), (7, 3, 16), (25, 9, 64), (4, 2, 80)])
def test_a_questions_rope_in_c_is_transformers_to_the_bit(rows, heads, head_dim, monkeypatch):
    """lean_decode's RoPE for a question's q or k rows: in C (decode_step.c's rope_rows, written head-major) the same
    bits as transformers' apply_rotary_pos_emb over the (1, heads, q, head_dim) view; PyTorch's ops without kernels."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from snapkv.engine.torch_question import with_rope

    torch.manual_seed(rows)
    projected = torch.randn(1, rows, heads * head_dim) * 30
    cos, sin = torch.randn(1, rows, head_dim), torch.randn(1, rows, head_dim)
    view = projected.view(1, rows, heads, head_dim).transpose(1, 2)
    expected, _ = apply_rotary_pos_emb(view, view, cos, sin)
    found = with_rope(projected, cos, sin, head_dim)
    assert found.shape == (1, heads, rows, head_dim) and found.is_contiguous() == (native.unavailable_reason() is None)
    assert torch.equal(found, expected)
    monkeypatch.setenv(native.SETTING, "off")
    assert torch.equal(with_rope(projected, cos, sin, head_dim), expected)


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama-gqa", "mistral", "qwen2", "qwen3"])
def test_lean_question_pass_is_the_models_forward_with_its_cut_to_the_bit(name, dtype, deferred, tmp_path,
                                                                           monkeypatch):
    """snapkv.engine.torch_question.question_pass: a question over a cache (restored into the room of a deferred one, or a
    plain copy), each layer cut as snapkv.compression.compress's hook cuts it: the same logits, the same kept positions and the
    same cached keys and values, bit for bit, as the model's forward under compressing(); with SnapKV's scores from
    the attention kernel's window sums in fp32. answer() takes a lean pass (and gives the same tokens) unless the engine
    is reference."""
    from snapkv.modeling import cpu_attention
    from snapkv.engine import lean_decode, native_question, torch_question
    from snapkv.storage.cachefile import load_cache, save_cache
    from snapkv.engine.generation import run_forward

    model = build_tiny(name, attn_implementation=cpu_attention.NAME).to(dtype)
    cache = prefill(model, random_ids(PROMPT_LENGTH, 5), None)
    if deferred:
        save_cache(tmp_path / "cache.snapkv", cache.at_precision(4))
        cache, _ = load_cache(tmp_path / "cache.snapkv", question_room=16, dtype=dtype)
    question = random_ids(6, 6)
    positions = torch.arange(PROMPT_LENGTH, PROMPT_LENGTH + 6)
    sums = []  # per C attention call: whether it gave the window's sums
    real_native = cpu_attention._attend_natively
    monkeypatch.setattr(cpu_attention, "_attend_natively",
                        lambda *a: (found := real_native(*a)) is not None and sums.append(found[1] is not None) or found)
    for cut in (None, Cut(24, 4), Cut(24, 8)):
        results = {}
        for way in ("forward", "lean"):
            working = WorkingCache.of(cache, model.config, for_question=True)
            assert lean_decode.qualifies(model, working)
            plan = CompressionPlan(cut, window=6) if cut else None
            if way == "forward":
                with compressing(model, plan) if plan else contextlib.nullcontext():
                    logits = run_forward(model, question.unsqueeze(0), working, positions.unsqueeze(0))
            else:
                logits = torch_question.question_pass(model, question, PROMPT_LENGTH, working, plan)
            results[way] = (logits, plan.kept if plan else {}, [layer.keys for layer in working.layers],
                            [layer.values for layer in working.layers])
        (logits, kept, keys, values), (lean_logits, lean_kept, lean_keys, lean_values) = results.values()
        assert torch.equal(lean_logits, logits)
        assert kept.keys() == lean_kept.keys() and (not cut or len(kept) == len(model.model.layers))
        assert all(torch.equal(kept[i], lean_kept[i]) for i in kept)
        assert all(torch.equal(a, b) for a, b in zip(keys + values, lean_keys + lean_values))
    if dtype == torch.float32 and native.unavailable_reason() is None:  # the C kernel's sums scored every cut
        assert sums == [False] * 6 + [True] * 12  # 3 layers x 2 ways: no cut, then two cuts
    passes = []
    for module in (torch_question, native_question):  # the lean passes, whichever engine's applies
        real = module.question_pass
        monkeypatch.setattr(module, "question_pass", lambda *a, real=real, **k: passes.append(1) or real(*a, **k))
    for cut in (None, Cut(24, 8)):
        tokens = list(answer(model, cache, question, per_question=cut, max_new_tokens=8, engine="reference"))
        assert not passes
        assert list(answer(model, cache, question, per_question=cut, max_new_tokens=8)) == tokens and passes
        passes.clear()


@pytest.mark.parametrize("name", ["phi3", "gemma3"])
def test_lean_decode_leaves_other_architectures_and_hooked_models_to_their_forward(name):
    from snapkv.engine import lean_decode

    model = build_tiny(name)
    cache = WorkingCache.of(prefill(model, random_ids(PROMPT_LENGTH, 5), None), model.config)
    assert not lean_decode.qualifies(model, cache)
    llama = build_tiny("llama-gqa")
    cache = WorkingCache.of(prefill(llama, random_ids(PROMPT_LENGTH, 5), None), llama.config)
    assert lean_decode.qualifies(llama, cache)
    handle = llama.model.layers[1].mlp.register_forward_hook(lambda *_: None)  # e.g. accelerate's device hooks
    assert not lean_decode.qualifies(llama, cache)
    handle.remove()
    assert not lean_decode.qualifies(build_tiny("llama-gqa", attn_implementation="eager"), cache)


def test_a_masks_question_columns_are_remembered_only_while_it_is_unchanged():
    """cpu_attention reads where a question's columns start, and whether they are causal, once per mask (every layer
    of a forward gets the same one); a mask changed in place, or another mask, is read again."""
    from snapkv.modeling.cpu_attention import _causal_after_prefix, _lower_triangular, _question_columns

    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool).tril(diagonal=7)
    assert _question_columns(mask) == _question_columns(mask) == 7 and _causal_after_prefix(mask)
    mask[0, 0, 2, 9] = False  # a row's own key masked: the earlier keys still all attended, the tail not causal
    assert _question_columns(mask) == 7 and not _causal_after_prefix(mask)
    mask[0, 0, 0, 1] = False  # an earlier key masked for one row
    assert _question_columns(mask) == 0 and not _causal_after_prefix(mask)
    additive = torch.zeros(1, 1, 3, 10).masked_fill_(~torch.ones(3, 10, dtype=torch.bool).tril(diagonal=7), -1e9)
    assert _question_columns(additive) == 7 and _causal_after_prefix(additive)
    square = torch.ones(5, 5, dtype=torch.bool).tril()  # read in bands of rows: every band checked
    assert _lower_triangular(square, block=2)
    square[4, 3] = False  # the last band's
    assert not _lower_triangular(square, block=2)
