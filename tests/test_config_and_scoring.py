"""Settings validation and the pure scoring functions."""

import pytest
import torch

from snapkv.compression.config import DEFAULTS, Cut, SnapKVConfig, Tier, Truncation
from snapkv.base.errors import ConfigError
from snapkv.compression.methods import (PseudoQuestion, Reconstruction, SnapKV, WindowAttention, method_from_dict,
                                        method_to_dict)
from snapkv.compression.scoring import gather_positions, kept_indices, mean_over_query_groups, pool_scores, window_attention_scores


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=0), "budget"),
    (dict(budget=-5), "budget"),
    (dict(budget=32, window=32), "budget"),
    (dict(window=0), "window"),
    (dict(kernel=4), "kernel"),
    (dict(kernel=0), "kernel"),
    (dict(pooling="median"), "pooling"),
    (dict(budget=1024, store_keep=None, store_budget=512), "store_budget"),
    (dict(store_keep=1.5), "fraction"),
    (dict(store_keep=0.5, store_budget=8192), "not both"),
    (dict(store_bits=5), "store_bits"),
    (dict(store_bits="4/16"), "values in 16 bits need keys in 16 bits too"),
    (dict(store_bits="4/x"), "KEYS/VALUES"),
    (dict(store_method="magic"), "magic"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SnapKVConfig(**kwargs)


def test_which_cut_at_prefill_and_which_per_question():
    query_aware = SnapKVConfig(budget=256, kernel=7, query_aware=True, store_keep=0.7)
    assert query_aware.stored_tier == Cut(None, 32, PseudoQuestion(kernel=7), keep=0.7)
    assert query_aware.mode == "query-aware"
    # the default file: the whole prompt, keys and values in 8 bits (chosen by `snapkv eval fidelity`)
    assert DEFAULTS.stored_tier is None and str(DEFAULTS.store_bits) == "8"
    # each question's cut keeps words whole by default (docs/how-it-works.md, Defaults, and why)
    assert query_aware.per_question == Cut(256, 32, SnapKV(kernel=7, pooling="max"), whole_words=True)
    assert SnapKVConfig(store_keep=None).stored_tier is None  # the whole prompt
    tier = SnapKVConfig(budget=256, query_aware=True, store_keep=None, store_budget=2048,
                        store_method="reconstruction").stored_tier
    assert tier == Cut(2048, 32, Reconstruction())
    tier = SnapKVConfig(budget=256, store_keep=0.5, store_method="snapkv", kernel=9).stored_tier
    assert tier == Cut(None, 32, SnapKV(kernel=9), keep=0.5)
    assert tier.sized_for(1000, range(20, 990)) == Cut(30 + 485, 32, SnapKV(kernel=9), keep=0.5)
    plain = SnapKVConfig(budget=256, query_aware=False)
    assert plain.stored_tier == Cut(256, 32, SnapKV()) and plain.per_question is None
    assert plain.mode == "document-window" and plain.stored_tier.prefix_keep == 256 - 32


def test_defaults_live_in_one_place():
    assert (DEFAULTS.budget, DEFAULTS.window, DEFAULTS.kernel, DEFAULTS.pooling) == (2048, 32, 15, "max")
    assert DEFAULTS.whole_words and DEFAULTS.cut.whole_words
    assert DEFAULTS.kernel == SnapKV().kernel and DEFAULTS.pooling == SnapKV().pooling
    assert DEFAULTS.query_aware and DEFAULTS.method == SnapKV.name


def test_cuts_and_tiers_round_trip_through_their_dicts():
    cut = Cut(512, 16, SnapKV(kernel=9, pooling="avg"))
    assert cut.to_dict() == {"budget": 512, "window": 16, "method": "snapkv", "kernel": 9, "pooling": "avg"}
    assert Cut.from_dict(cut.to_dict()) == cut
    tier = Tier(cut, 4, Truncation("middle", 300))
    assert Tier.from_dict(tier.to_dict()) == tier and Tier.from_dict(Tier().to_dict()) == Tier()
    assert "middle" in tier.describe() and "300" in tier.describe() and "4-bit" in tier.describe()
    assert Tier().describe() == "whole prompt, 16-bit"
    fraction = Cut(None, 8, Reconstruction(chunk=256), keep=0.25)
    assert Cut.from_dict(fraction.to_dict()) == fraction and "25% of the document" in fraction.describe()


def test_methods_are_named_and_unknown_ones_refused():
    assert method_from_dict(method_to_dict(SnapKV(kernel=5))) == SnapKV(kernel=5)
    with pytest.raises(ConfigError, match="unknown compression method 'h2o'"):
        method_from_dict({"method": "h2o"})
    with pytest.raises(ConfigError, match="not understood"):
        method_from_dict({"method": "snapkv", "colour": "blue"})
    with pytest.raises(ConfigError, match="method"):
        SnapKVConfig(method="h2o")


def test_window_scores_are_a_causal_softmax():
    torch.manual_seed(0)
    queries = torch.randn(1, 4, 3, 8)  # (batch, q_heads, w, d)
    keys = torch.randn(1, 2, 10, 8)    # (batch, kv_heads, n, d)
    scores = window_attention_scores(queries, keys, scaling=8 ** -0.5)
    assert scores.shape == (1, 4, 7)
    # plain recomputation: head h uses kv head h // 2; window query i sees keys 0..7+i
    for head in range(4):
        expected = torch.zeros(7)
        for i in range(3):
            logits = keys[0, head // 2, : 8 + i] @ queries[0, head, i] * 8 ** -0.5
            expected += logits.softmax(-1)[:7]
        assert torch.allclose(scores[0, head], expected, atol=1e-6)


def test_pooling_keeps_length_and_spreads_peaks():
    scores = torch.zeros(1, 1, 9)
    scores[0, 0, 4] = 1.0
    pooled = pool_scores(scores, 3, "max")
    assert pooled.shape == scores.shape
    assert pooled[0, 0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert torch.allclose(pool_scores(scores, 3, "avg")[0, 0, 3:6], torch.full((3,), 1 / 3))
    assert torch.equal(pool_scores(scores, 1, "max"), scores)


def test_group_mean_and_selection():
    scores = torch.tensor([[[1.0, 5.0, 0.0, 2.0], [3.0, 1.0, 0.0, 0.0]]])  # (1, 2 q heads, 4)
    grouped = mean_over_query_groups(scores, kv_heads=1)
    assert torch.equal(grouped, torch.tensor([[[2.0, 3.0, 0.0, 1.0]]]))
    kept = kept_indices(grouped, prefix_keep=2, window=3)
    # positions 0..3 are the prefix, whose best two are 1 and 0; the window follows: 4, 5, 6
    assert kept.tolist() == [[[0, 1, 4, 5, 6]]]
    states = torch.arange(7.0).view(1, 1, 7, 1).expand(1, 1, 7, 2)
    assert torch.equal(gather_positions(states, kept)[0, 0, :, 0], kept[0, 0].float())


def test_chunks_rank_as_one_and_are_kept_whole():
    from snapkv.compression.methods import Chunks
    from snapkv.compression.scoring import chunk_means

    scores = torch.tensor([[[0.0, 9.0, 0.0, 1.0, 1.0, 1.0, 5.0]]])  # (1, 1 head, 7): chunks of 3: [0-2] [3-5] [6]
    assert torch.allclose(chunk_means(scores, 3), torch.tensor([[[3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 5.0]]]))
    assert torch.equal(chunk_means(scores, 1), scores)
    # SnapKV keeps the single peak 9 and the 5; by chunks the whole chunk around the peak goes with it
    kept = kept_indices(chunk_means(scores, 3), prefix_keep=4, window=1)
    assert kept.tolist() == [[[0, 1, 2, 6, 7]]]
    torch.manual_seed(1)
    window = torch.rand(1, 2, 3, 4, 40).softmax(-1)  # (batch, kv_heads, group, w, n - w)
    chunked = Chunks(size=8, kernel=3).score(WindowAttention(None, weights=window))
    assert chunked.shape == (1, 2, 40)
    assert torch.equal(chunked, chunk_means(SnapKV(kernel=3).score(WindowAttention(None, weights=window)), 8))
    assert method_from_dict(method_to_dict(Chunks(size=4))) == Chunks(size=4)
    assert SnapKVConfig(method="chunks", kernel=7).cut.method == Chunks(kernel=7)
    with pytest.raises(ConfigError, match="at least 1 position"):
        Chunks(size=0)


def test_a_pyramid_cut_keeps_more_below_and_fewer_above_and_as_many_in_all():
    flat, pyramid = Cut(2048, 32), Cut(2048, 32, pyramid=True)
    layers = 30
    kept = [pyramid.prefix_keep_at(layer, layers) for layer in range(layers)]
    assert kept[0] == 3024 and kept[-1] == 1008 and kept == sorted(kept, reverse=True)  # 1.5x down to 0.5x
    assert abs(sum(kept) - layers * flat.prefix_keep) <= layers // 2  # the same in all, within rounding
    assert {flat.prefix_keep_at(layer, layers) for layer in range(layers)} == {flat.prefix_keep}
    assert Cut.from_dict(pyramid.to_dict()) == pyramid and "pyramid" not in flat.to_dict()
    assert SnapKVConfig(pyramid=True).per_question.pyramid
    assert not SnapKVConfig(pyramid=True, query_aware=False).stored_tier.pyramid  # the prefill's cut ignores it


def test_whole_words_rank_as_their_best_token_and_are_kept_whole():
    from snapkv.compression.scoring import word_maxima

    scores = torch.tensor([[[0.1, 0.9, 0.2, 0.3, 0.0, 0.5]]])  # (1, 1 head, 6)
    words = torch.tensor([[0, 0, 0, 1, 2, 2]])  # (1 head, 6): a three-token number, a word, a two-token name
    assert torch.equal(word_maxima(scores, words), torch.tensor([[[0.9, 0.9, 0.9, 0.3, 0.5, 0.5]]]))
    # per token the best three are 1, 5, 3 (the number cut to its second digit); by words: the number whole
    assert kept_indices(scores, 3, 1).tolist() == [[[1, 3, 5, 6]]]
    assert kept_indices(word_maxima(scores, words), 3, 1).tolist() == [[[0, 1, 2, 6]]]
    torch.manual_seed(2)
    for _ in range(20):  # random words of 1-6 tokens: every kept word whole, but for at most one per head
        lengths = torch.randint(1, 7, (200,))
        per_head = torch.repeat_interleave(torch.arange(200), lengths)[:200]  # (200,)
        words = torch.stack([per_head, per_head + 1000])  # (2 heads, 200): ids need only ascend
        kept = kept_indices(word_maxima(torch.rand(1, 2, 200), words), 50, 4)[0, :, :-4]  # (2, 50)
        for head in range(2):
            held = set(kept[head].tolist())
            partial = [w for w in set(words[head, kept[head]].tolist())
                       if not all(p in held for p in (words[head] == w).nonzero().flatten().tolist())]
            assert len(partial) <= 1
    cut = Cut(512, 16, SnapKV(), whole_words=True)
    assert Cut.from_dict(cut.to_dict()) == cut and "whole words" in cut.describe()
    assert "whole_words" not in Cut(512, 16).to_dict()  # files of a plain cut read as before
    assert SnapKVConfig(whole_words=True).per_question.whole_words
    assert not SnapKVConfig(whole_words=True, query_aware=False).stored_tier.whole_words  # a prefill has no words


def test_a_prefill_in_chunks_is_a_snapkv_tier_that_says_so_and_survives_a_file():
    from snapkv.compression.config import Cut, SnapKVConfig
    from snapkv.engine.memory import estimate_prefill

    document_window = SnapKVConfig(budget=512, query_aware=False, prefill_chunk=2048)
    assert document_window.stored_tier.budget == 512 and document_window.mode == "document-window"
    query_aware = SnapKVConfig(budget=512, prefill_chunk=2048)
    tier = query_aware.stored_tier
    assert (tier.budget, tier.chunk, tier.method.name) == (4 * 512, 2048, "snapkv") and query_aware.mode == "query-aware"
    assert "chunks of 2048" in tier.describe()
    assert Cut.from_dict(tier.to_dict()) == tier
    with pytest.raises(ConfigError, match="chunks"):
        SnapKVConfig(prefill_chunk=16)  # no longer than the window
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8)
    exact = estimate_prefill(config, 131072, torch.bfloat16, Cut(1024, 32))
    chunked = estimate_prefill(config, 131072, torch.bfloat16, Cut(1024, 32, chunk=4096))
    at_16k = estimate_prefill(config, 16384, torch.bfloat16, Cut(1024, 32, chunk=4096))
    assert chunked.total_bytes < exact.total_bytes / 10 and chunked.total_bytes == at_16k.total_bytes


def _torch_and_native(monkeypatch, compute):
    """compute() with snapkv's C kernels turned off, then on (skipped where they are unavailable)."""
    from snapkv import native

    if native.unavailable_reason() is not None:
        pytest.skip(f"C kernels unavailable: {native.unavailable_reason()}")
    with monkeypatch.context() as patch:
        patch.setenv(native.SETTING, "off")
        by_torch = compute()
    return by_torch, compute()


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 3, 5, 7, 9, 15, 17])
def test_the_c_cut_scores_as_pytorch_does(monkeypatch, pooling, kernel):
    """snapkv/native/kernels/window_cut.c's scores from a strided view of the window's weights (the last rows of each query
    head, the columns before the window), as SnapKV.score computes them in PyTorch, within fp32 rounding
    (kernels whose max pooling takes two overlapping runs of a power of two, or one exactly)."""
    torch.manual_seed(3)
    weights = torch.randn(1, 3, 2, 9, 300).softmax(dim=-1)  # (batch, kv_heads, group, question rows, n)
    window = weights[..., -6:, : 300 - 6]
    by_torch, natively = _torch_and_native(monkeypatch, lambda: SnapKV(kernel=kernel, pooling=pooling).score(WindowAttention(None, weights=window)))
    assert natively.shape == by_torch.shape == (1, 3, 294)
    assert torch.allclose(natively, by_torch, rtol=1e-6, atol=1e-9)


def test_the_c_cut_keeps_the_best_positions_and_the_earliest_among_ties(monkeypatch):
    torch.manual_seed(4)
    distinct = torch.randperm(2 * 500).float().view(1, 2, 500)  # no two scores alike: one right answer
    by_torch, natively = _torch_and_native(monkeypatch, lambda: kept_indices(distinct, 64, 7))
    assert torch.equal(natively, by_torch)
    assert natively.shape == (1, 2, 71) and natively[0, :, -7:].tolist() == [list(range(500, 507))] * 2
    tied = torch.zeros(1, 1, 10)
    tied[0, 0, 6] = 1.0
    _, natively = _torch_and_native(monkeypatch, lambda: kept_indices(tied, 3, 2))
    assert natively.tolist() == [[[0, 1, 6, 10, 11]]]  # 6, then the two earliest of the zeros
    assert kept_indices(tied, 20, 2).tolist() == [[list(range(12))]]  # more asked than there are: all of them
    with_nan = distinct.clone()
    with_nan[0, 1, 3] = float("nan")  # refused by the kernel: PyTorch's topk decides, as before
    by_torch, natively = _torch_and_native(monkeypatch, lambda: kept_indices(with_nan, 64, 7))
    assert torch.equal(natively, by_torch)


def test_the_c_cut_gathers_rows_from_a_view_with_room(monkeypatch):
    """Rows of a (1, heads, tokens, head_dim) view of a buffer with free rows after each head's tokens (as
    snapkv.storage.deferred lends it), the same as PyTorch's indexing; an index past the tokens is refused by the kernel and
    PyTorch raises, as before."""
    torch.manual_seed(5)
    buffer = torch.randn(1, 3, 120, 16)
    states = buffer[:, :, :100]
    indices = torch.sort(torch.stack([torch.randperm(100)[:30] for _ in range(3)]), dim=-1).values.unsqueeze(0)
    by_torch, natively = _torch_and_native(monkeypatch, lambda: gather_positions(states, indices))
    assert torch.equal(natively, by_torch) and natively.is_contiguous()
    for dtype in (torch.bfloat16, torch.float16):  # whole rows whatever their type
        expected = states.to(dtype)[0, torch.arange(3).view(3, 1), indices[0]].unsqueeze(0)
        assert torch.equal(gather_positions(states.to(dtype), indices), expected)
    with pytest.raises(IndexError):
        gather_positions(states, torch.full((1, 3, 2), 100))


def test_a_plan_resolves_the_settings_once():
    """Plan: the stored tier, its bits and each question's cut, read from SnapKVConfig once; where the stored cut is
    made (during the prefill for SnapKV's document window, after it by probes for the query-aware tiers)."""
    from snapkv.base.bits import Bits
    from snapkv.compression.config import Plan

    whole = Plan.of(None)
    assert whole == Plan(None, Bits(16), None) and whole.mode == "full"
    assert whole.during_prefill is None and whole.after_prefill is None
    default = Plan.of(SnapKVConfig())
    assert default.bits == Bits(8) and default.per_question == SnapKVConfig().per_question
    window = Plan.of(SnapKVConfig(query_aware=False, budget=512))
    assert window.during_prefill == window.stored and window.after_prefill is None
    shared = Plan.of(SnapKVConfig(store_keep=0.5, store_method="pseudo-question"))
    sized = shared.sized_for(1000, range(100, 900))
    assert shared.stored.budget is None and sized.stored.budget == 200 + 400  # around the document + half of it
    assert sized.after_prefill == sized.stored and sized.during_prefill is None
