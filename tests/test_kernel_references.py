"""Every vector kernel with a scalar reference (snapkv/native/kernels/reference.c) gives the reference's values within
fp32 rounding, in the build this CPU loads (tests/test_kernel_interface.py runs these again with every other build
this CPU runs); each reference is first checked against PyTorch in double precision, so the oracle itself is right."""

import pytest
import torch

from snapkv import native

has_kernels = native.unavailable_reason() is None
pytestmark = pytest.mark.skipif(not has_kernels, reason=f"no kernels: {native.unavailable_reason()}")


def _call(name: str, *arguments) -> int:
    return getattr(native.kernels(), name)(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in arguments))


def _both(name: str, outputs: list[torch.Tensor], *arguments) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The kernel's outputs and its reference's, each into fresh copies of `outputs` (placeholders in `arguments`)."""
    found = []
    for function in (name, f"{name}_generic"):
        fresh = [torch.full_like(t, float("nan")) if t.is_floating_point() else torch.zeros_like(t) for t in outputs]
        by_identity = {id(t): copy for t, copy in zip(outputs, fresh)}
        placed = [by_identity.get(id(a), a) for a in arguments]
        assert _call(function, *placed) == 0, function
        found.append(fresh)
    return found[0], found[1]


def _blocks(bits: int, n: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random 4- or 8-bit blocks (codes, scale, minimum or None) and the fp64 weights (n, k) they stand for."""
    scale = torch.rand(n, k // 32, generator=generator) / 20
    if bits == 8:
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        weights = codes.double() * scale.double().repeat_interleave(32, dim=1)
        return codes, scale, None, weights
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
    blocks = codes.view(n, k // 32, 16)
    q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, k)  # weight j low nibble, j + 16 high
    minimum = -torch.rand(n, k // 32, generator=generator) / 10
    weights = (q.float() * scale.repeat_interleave(32, dim=1) + minimum.repeat_interleave(32, dim=1)).double()
    return codes, scale, minimum, weights


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("bits", [4, 8])
def test_block_products_give_their_references_values(bits, rows):
    generator = torch.Generator().manual_seed(bits * 10 + rows)
    n, k = 40, 128
    x = torch.randn(rows, k, generator=generator)
    codes, scale, minimum, weights = _blocks(bits, n, k, generator)
    y = torch.empty(rows, n)
    reference_of = (x.double() @ weights.T).float()
    if bits == 4:
        kernel, reference = _both("matmul_4bit", [y], x, rows, k, codes, scale, minimum, n, y, 2)
    else:
        kernel, reference = _both("matmul_8bit", [y], x, rows, k, codes, scale, n, y, 2)
    torch.testing.assert_close(reference[0], reference_of, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kernel[0], reference[0], rtol=1e-5, atol=1e-5)
    kernel, reference = _both("linear_rows_blocks", [y], x, rows, k, bits, codes, scale, minimum, n, y, 2)
    torch.testing.assert_close(reference[0], reference_of, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kernel[0], reference[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("bf16", [False, True])
def test_dense_products_give_their_references_values(bf16, rows):
    generator = torch.Generator().manual_seed(rows + 100 * bf16)
    n, k = 37, 72
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator)
    if bf16:
        weight = weight.to(torch.bfloat16)
    y = torch.empty(rows, n)
    reference_of = (x.double() @ weight.double().T).float()
    rows_kernel = ("linear_rows_bf16", "linear_rows")[not bf16]
    for kernel, reference in (_both("matmul_dense", [y], x, rows, k, weight, int(bf16), n, y, 2),
                              _both(rows_kernel, [y], x, rows, k, weight, n, y, 2)):
        torch.testing.assert_close(reference[0], reference_of, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kernel[0], reference[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim, tokens", [(64, 300), (80, 517)])
def test_a_questions_attention_gives_its_references_values(head_dim, tokens):
    generator = torch.Generator().manual_seed(head_dim + tokens)
    kv_heads, group, question, window = 2, 3, 7, 4
    rows = group * question
    query = torch.randn(kv_heads, rows, head_dim, generator=generator)
    keys, values = (torch.randn(kv_heads, tokens, head_dim, generator=generator) for _ in range(2))
    tail = torch.zeros(question, question).masked_fill_(torch.ones(question, question).triu(1).bool(), float("-inf"))
    weights, out = torch.empty(kv_heads, rows, tokens), torch.empty(kv_heads, rows, head_dim)
    sums = torch.empty(kv_heads, group, tokens)
    kernel, reference = _both("attend_rows", [weights, out, sums], query, kv_heads, rows, question, 0.125, keys,
                              tokens * head_dim, values, tokens * head_dim, tokens, head_dim, tail, weights, out,
                              window, sums, 2)
    scores = (query.double() * 0.125) @ keys.double().transpose(1, 2)  # (kv_heads, rows, tokens)
    scores[..., tokens - question:] += tail.double().repeat(group, 1)
    softmax = scores.softmax(dim=-1)
    torch.testing.assert_close(reference[1], (softmax @ values.double()).float(), rtol=1e-5, atol=1e-6)
    in_window = softmax.view(kv_heads, group, question, tokens)[:, :, question - window:].sum(dim=2)
    torch.testing.assert_close(reference[2], in_window.float(), rtol=1e-5, atol=1e-7)
    for found, expected in zip(kernel, reference):  # numerators, output, window sums
        torch.testing.assert_close(found, expected, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis, group, rotated", [("tokens", 32, False), ("channels", 16, False),
                                                  ("tokens", 128, True), ("channels", 64, True)])
def test_restoring_saved_codes_gives_the_references_values(bits, axis, group, rotated):
    from snapkv.base.bits import CHANNELS, TOKENS, Scheme
    from snapkv.storage.quantize import dequantize, quantize

    generator = torch.Generator().manual_seed(bits)
    heads, tokens, head_dim = 3, 77, 64
    x = torch.randn(heads, tokens, head_dim, generator=generator) * torch.linspace(0.1, 4, head_dim)
    stored = quantize(x, Scheme(bits, TOKENS if axis == "tokens" else CHANNELS, group, rotated))
    packed, scale, minimum = (t.contiguous() for t in (stored.packed, stored.scale, stored.minimum))
    destination = torch.randperm(heads * tokens, generator=generator)
    for out_kind, dtype in ((0, torch.float32), (1, torch.bfloat16)):
        out = torch.empty(heads * tokens, head_dim, dtype=dtype)
        kernel, reference = _both("dequantize_rows", [out], packed, scale, minimum, heads, tokens, head_dim, bits,
                                  int(axis == "tokens"), group, 64 if rotated else 0, destination, out, out_kind, 2)
        expected = torch.empty(heads * tokens, head_dim, dtype=dtype)
        expected[destination] = dequantize(stored, torch.float32).reshape(-1, head_dim).to(dtype)
        if rotated:  # the transform sums in another order than the reference's matrix product
            torch.testing.assert_close(reference[0].float(), expected.float(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(kernel[0].float(), reference[0].float(), rtol=1e-5, atol=1e-5)
        else:  # a code times its scale, plus its minimum: the same bits everywhere
            assert torch.equal(reference[0], expected) and torch.equal(kernel[0], reference[0])


@pytest.mark.parametrize("keys_rotated", [False, True])
def test_restoring_a_questions_kept_positions_gives_the_references_values(keys_rotated):
    """A saved layer in two parts (a sharper share and the rest), read at kept positions, the question's own rows
    after the stored ones: the kernel, its reference and PyTorch's restore of the whole layer agree."""
    import ctypes

    from snapkv.base.bits import TOKENS, Scheme
    from snapkv.storage.quantize import dequantize, quantize_mixed

    generator = torch.Generator().manual_seed(5)
    heads, stored, head_dim, question, kept = 2, 90, 64, 6, 40
    x = torch.randn(heads, stored, head_dim, generator=generator)
    sharp = torch.zeros(heads, stored, dtype=torch.bool)
    for h in range(heads):
        sharp[h, torch.randperm(stored, generator=generator)[:20]] = True
    mixed = quantize_mixed(x, sharp, Scheme(8, TOKENS, 16), Scheme(4, TOKENS, 32, rotated=keys_rotated))
    parts = [mixed.high, mixed.low]
    tensors = [t.contiguous() for part in parts for t in (part.packed, part.scale, part.minimum)]
    pointers = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
    shapes = torch.tensor([[part.shape[1], part.scheme.bits, 1, part.scheme.group,
                            64 if part.scheme.rotated else 0] for part in parts], dtype=torch.int64)
    columns = torch.empty(heads, stored, dtype=torch.int64)
    native.kernels().part_columns(sharp.contiguous().data_ptr(), heads, stored, columns.data_ptr())
    positions = torch.stack([torch.randperm(stored + question, generator=generator)[:kept].sort().values
                             for _ in range(heads)])
    own = torch.randn(heads, question, head_dim, generator=generator)
    out = torch.empty(heads * kept, head_dim)
    kernel, reference = _both("dequantize_positions", [out], pointers, shapes, 2, columns, heads, stored, head_dim,
                              positions, kept, own, question, out, 2)
    whole = torch.cat([dequantize(mixed, torch.float32), own], dim=1)  # (heads, stored + question, head_dim)
    expected = torch.stack([whole[h, positions[h]] for h in range(heads)]).reshape(-1, head_dim)
    torch.testing.assert_close(reference[0], expected, rtol=1e-5, atol=1e-5)
    if keys_rotated:
        torch.testing.assert_close(kernel[0], reference[0], rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(kernel[0], reference[0])


class _References:
    """native.kernels() with every kernel that has a reference answered by its reference instead."""

    def __init__(self, library) -> None:
        self._library = library
        self.answered = set()  # the kernels a reference answered for

    def __getattr__(self, name: str):
        if name in native.REFERENCED:
            self.answered.add(name)
            name += "_generic"
        return getattr(self._library, name)


@pytest.mark.parametrize("weights", ["blocks", "bf16", "qwen2", "qwen3"])
def test_a_decoded_token_and_a_questions_layers_give_their_references_values(weights, monkeypatch):
    """decode_token, question_before_attention and question_after_attention through the native engine on a tiny
    model (4/8-bit blocks, a Llama or Qwen2 with its q/k/v biases or Qwen3 with its q and k norms; or bf16 rows, read by
    the dense kernels, over its bf16 cache), against the same steps with every kernel answered by its reference:
    logits within fp32 rounding, token after token, and the same answer."""
    import test_dense_weights
    import test_native_decode
    from snapkv.compression.config import Cut
    from snapkv.engine import native_decode
    from snapkv.engine.generation import answer, prefill

    prompt, question = test_native_decode.PROMPT, test_native_decode.QUESTION
    if weights != "bf16":
        model = (test_native_decode.on_blocks(num_attention_heads=4, num_key_value_heads=2) if weights == "blocks"
                 else test_native_decode.on_blocks(weights))
        question_pass = lambda: test_native_decode.after_question(model, room=6)[1]  # noqa: E731
    else:
        model, _ = test_dense_weights.twins(torch.bfloat16)
        question_pass = lambda: test_dense_weights.after_question(model, 6, torch.float32)[0]  # noqa: E731
    library = native.kernels()
    references = _References(library)
    found = []
    for kernels in (library, references):
        monkeypatch.setattr(native, "kernels", lambda: kernels)
        stepper = native_decode.for_cache(model, question_pass(), prompt + question, 6)
        assert stepper is not None
        logits = [stepper.step(token, prompt + question + step) for step, token in enumerate([5, 17, 99, 3])]
        cache = prefill(model, test_native_decode.ids(prompt, 1), None)
        tokens = list(answer(model, cache, test_native_decode.ids(question, 2), per_question=Cut(64, 8),
                             max_new_tokens=12))
        found.append((torch.stack(logits), tokens))
    (kernel_logits, kernel_tokens), (reference_logits, reference_tokens) = found
    # a bf16 model's question pass is PyTorch's, its logits final_logits' (the head's product inside it matmul_dense's)
    expected = {"decode_token", "final_logits"} | (
        {"question_before_attention", "question_after_attention"} if weights != "bf16" else set())
    assert expected <= references.answered
    torch.testing.assert_close(kernel_logits, reference_logits, rtol=1e-4, atol=1e-5 * reference_logits.abs().max())
    assert kernel_tokens == reference_tokens


@pytest.mark.parametrize("bits, method", [("3/2+20%@8/4", "snapkv"), ("4/3", "words"), ("8", "chunks"),
                                         ("8", "average")])
def test_a_questions_attention_and_cut_from_the_codes_give_their_references_values(bits, method, tmp_path,
                                                                                     monkeypatch, vector_width):
    """attend_coded (and dequantize_positions, the cut's restore) through a question's pass over a saved cache (two parts with a sharper share, rotated
    keys and values, neither; SnapKV's max pooling, whole words, chunks, an average pooling) against the same pass with
    the reference: logits within fp32 rounding, the same positions kept, and the kept rows within rounding."""
    from snapkv.base.bits import Bits
    from snapkv.compression.compress import CompressionPlan
    from snapkv.compression.config import Cut
    from snapkv.compression.methods import Chunks, SnapKV
    from snapkv.engine import native_decode, native_question
    from snapkv.engine.working_cache import WorkingCache
    import test_coded_attention as coded

    vector_width(True)  # the coded path's 16-lane functions
    model = coded.on_blocks(hidden_size=128, num_attention_heads=2, num_key_value_heads=2)
    cache = coded.saved(model, Bits.parse(bits), tmp_path / "cache.snapkv")
    layers, question = native_decode.question_layers(model), coded.ids(coded.QUESTION, 2)
    library = native.kernels()
    references = _References(library)
    found = []
    for kernels in (library, references):
        monkeypatch.setattr(native, "kernels", lambda: kernels)
        cut = {"snapkv": Cut(64, 8, SnapKV()), "words": Cut(64, 8, SnapKV(), whole_words=True),
               "chunks": Cut(64, 8, Chunks(size=8)), "average": Cut(64, 8, SnapKV(pooling="avg"))}[method]
        plan = CompressionPlan(cut, window=coded.QUESTION)
        if method == "words":
            words = torch.repeat_interleave(torch.arange(coded.PROMPT), torch.randint(
                1, 6, (coded.PROMPT,), generator=torch.Generator().manual_seed(5)))[:coded.PROMPT]
            plan.words = [words.expand(2, -1)] * len(model.model.layers)
        working = WorkingCache.of(cache, model.config, for_question=True)
        logits = native_question.question_pass(model, question, coded.PROMPT, working, plan, layers)
        found.append((logits, plan.kept, [(layer.keys, layer.values) for layer in working.layers]))
    assert {"attend_coded", "dequantize_positions"} <= references.answered
    (kernel_logits, kernel_kept, kernel_rows), (logits, kept, rows) = found
    torch.testing.assert_close(kernel_logits, logits, rtol=1e-4, atol=1e-5 * logits.abs().max())
    assert all(torch.equal(kernel_kept[i], kept[i]) for i in kept) and kernel_kept.keys() == kept.keys()
    for (kernel_keys, kernel_values), (keys, values) in zip(kernel_rows, rows):
        torch.testing.assert_close(kernel_keys, keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kernel_values, values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_products_over_gguf_blocks_give_their_references_values(type_name, rows):
    from gguf_samples import gguf_py_weights, random_blocks

    from snapkv.modeling.gguf_file import TENSOR_TYPES

    type_id = next(number for number, (name, _, _) in TENSOR_TYPES.items() if name == type_name)
    n, k = 21, 512
    blocks = random_blocks(type_name, n, k, torch.Generator().manual_seed(rows))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    y = torch.empty(rows, n)
    reference_of = (x.double() @ gguf_py_weights(type_name, blocks).double().T).float()
    kernel, reference = _both("gguf_matmul", [y], x, rows, k, type_id, blocks, blocks.shape[1], n, y, 2)
    torch.testing.assert_close(reference[0], reference_of, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kernel[0], reference[0], rtol=2e-5, atol=2e-5 * reference_of.abs().max().item())


# the exported functions that need no reference: plain scalar C already (checked below), or about the build
SCALAR = ("rope_rows", "window_scores", "chunk_means", "word_maxima", "top_positions", "gather_rows", "mask_positions",
          "part_rows", "part_columns", "half_all_finite", "gguf_block_form", "gguf_dequantize", "gguf_rows")
ABOUT_THE_BUILD = ("kernel_variant", "kernel_threads", "wide_vectors")


def test_every_kernel_is_scalar_or_has_a_reference_compared_with_it_here():
    """Each exported function is about the build, plain scalar C (no vector types or operations in its body), or a vector
    kernel whose reference `<name>_generic` is bound with its arguments and named in a test of this file."""
    import re
    from pathlib import Path

    references = {f"{name}_generic" for name in native.REFERENCED}
    assert set(native.BINDINGS) == set(native.REFERENCED) | references | set(SCALAR) | set(ABOUT_THE_BUILD)
    sources = "\n".join(path.read_text() for path in (Path(native.__file__).parent / "kernels").glob("*.c"))
    for name in SCALAR:
        body = re.search(rf"^\w[\w ]* \**{name}\(.*?^}}$", sources, re.S | re.M)
        vectors = re.findall(r"\b(?:f32x|i32x|u8x|mask16|_mm|__m)\w*", body.group(0)) if body else None
        assert vectors == [], name  # no vector types or operations (vectors.h's, or an intrinsic)
    text = Path(__file__).read_text()
    assert [name for name in native.REFERENCED if f'"{name}"' not in text] == []  # each named in a test above
    for name in native.REFERENCED:
        assert native.BINDINGS[f"{name}_generic"] == native.BINDINGS[name]
