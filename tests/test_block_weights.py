"""Weights kept as exact 4/8-bit blocks and decoded by snapkv's C kernel (snapkv.modeling.block_weights, snapkv.native)."""

import json

import pytest
import torch

from snapkv.modeling import block_weights
from snapkv import native
from snapkv.modeling.block_weights import BlockLinear, exact_blocks, use_block_weights
from snapkv.measure.floor import weight_bytes_per_token
from snapkv.engine.generation import answer, prefill
from snapkv.engine.working_cache import WorkingCache

from conftest import build_tiny

needs_kernels = pytest.mark.skipif(native.unavailable_reason() is not None,
                                   reason=f"kernels unavailable: {native.unavailable_reason()}")


def four_bit_weight(out: int, inputs: int, seed: int = 0) -> torch.Tensor:
    """(out, inputs) fp32 that is exactly Q4_1 blocks: scale * q + minimum, fp16 scale and minimum."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, inputs // 32, 32), generator=generator).float()
    codes[:, :, 0], codes[:, :, 1] = 0, 15  # as a quantizer leaves them: the block's extremes
    scale = (torch.rand(out, inputs // 32, 1, generator=generator) * 0.02).half().float()
    minimum = (-torch.rand(out, inputs // 32, 1, generator=generator) * 0.1).half().float()
    return (codes * scale + minimum).reshape(out, inputs)


def eight_bit_weight(out: int, inputs: int, seed: int = 0) -> torch.Tensor:
    """(out, inputs) fp32 that is exactly Q8_0 blocks: scale * q, q in -127..127, fp16 scale."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out, inputs // 32, 32), generator=generator).float()
    codes[:, :, 0] = 127
    scale = (torch.rand(out, inputs // 32, 1, generator=generator) * 0.01).half().float()
    return (codes * scale).reshape(out, inputs)


def rebuilt(blocks) -> torch.Tensor:
    """The fp32 weight the blocks stand for, unpacked here in Python (independent of the C kernel)."""
    out = blocks.scale.shape[0]
    if blocks.bits == 8:
        return (blocks.codes.float().reshape(out, -1, 32) * blocks.scale[..., None]).reshape(out, -1)
    packed = blocks.codes.reshape(out, -1, 16)
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()  # (out, blocks, 32): elements j, j + 16
    return (codes * blocks.scale[..., None] + blocks.minimum[..., None]).reshape(out, -1)


def snap_to_blocks(model) -> None:
    """Round every linear weight of a tiny model to Q4_1-like blocks (the output head to Q8_0), in place,
    so that the model is exactly what a GGUF file would hold."""
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear:
            continue
        weight = module.weight.data
        grouped = weight.reshape(weight.shape[0], -1, 32)
        if name.endswith("lm_head"):
            scale = (grouped.abs().amax(-1, keepdim=True) / 127).half().float()
            grouped.copy_((grouped / scale).round() * scale)
            continue
        smallest = grouped.amin(-1, keepdim=True).half().float()
        scale = ((grouped.amax(-1, keepdim=True) - smallest) / 15).half().float()
        grouped.copy_(((grouped - smallest) / scale).round().clamp(0, 15) * scale + smallest)


@pytest.mark.parametrize("make, bits", [(four_bit_weight, 4), (eight_bit_weight, 8)])
def test_exact_blocks_give_back_every_weight(make, bits):
    weight = make(96, 128)
    blocks = exact_blocks(weight)
    assert blocks is not None and blocks.bits == bits
    assert torch.equal(rebuilt(blocks), weight)
    assert blocks.nbytes == weight.numel() * (0.75 if bits == 4 else 1.125)  # codes + fp32 scale (+ minimum) per 32
    weight[0] = 0  # a first row that would fit 4-bit blocks too (one value per block): the rest decides
    blocks = exact_blocks(weight)
    assert blocks is not None and blocks.bits == bits and torch.equal(rebuilt(blocks), weight)


def test_weights_that_are_not_blocks_are_left_alone():
    assert exact_blocks(torch.randn(64, 128)) is None  # a float checkpoint: rounding would change it
    assert exact_blocks(four_bit_weight(64, 128).bfloat16()) is None  # not fp32
    assert exact_blocks(torch.zeros(8, 48)) is None  # 48 inputs: not whole blocks
    nearly = four_bit_weight(64, 128)
    nearly[3, 70] += 1e-4  # one weight off the grid
    assert exact_blocks(nearly) is None or exact_blocks(nearly).bits == 8 and torch.equal(
        rebuilt(exact_blocks(nearly)), nearly)


@needs_kernels
@pytest.mark.parametrize("make", [four_bit_weight, eight_bit_weight])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_kernel_matches_the_fp32_product(make, rows):
    weight = make(200, 576, seed=rows)
    blocks = exact_blocks(weight)
    x = torch.randn(rows, 576)
    expected = x.double() @ weight.double().T
    got = block_weights.blockwise_matmul(x, blocks, 200)
    assert got.shape == (rows, 200)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("make", [four_bit_weight, eight_bit_weight])
@pytest.mark.parametrize("inputs", [64, 576, 1536])
def test_one_row_matches_the_fp32_product_with_either_vector_width(make, inputs, wide, vector_width):
    """A decoded token's product: 8-float vectors, or 16 on a CPU with AVX-512 (blocks summed in another order,
    the minimum's share by masked vectors past a multiple of 16 blocks), each prefetching the weights ahead
    (also past the matrix's last output, which a prefetch may do)."""
    if vector_width(wide) != wide:
        pytest.skip("this CPU lacks AVX-512")
    weight = make(203, inputs, seed=inputs)
    blocks = exact_blocks(weight)
    x = torch.randn(1, inputs)
    expected = x.double() @ weight.double().T
    got = block_weights.blockwise_matmul(x, blocks, 203)
    assert got.shape == (1, 203)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_kernels
def test_block_linear_uses_the_block_kernel_for_one_row_few_rows_for_a_question_and_pytorch_for_a_prompt(
        monkeypatch):
    linear = torch.nn.Linear(64, 96, bias=True)
    linear.weight.data = four_bit_weight(96, 64)
    layer = BlockLinear(linear, exact_blocks(linear.weight))
    calls = []
    for name in ("blockwise_matmul", "few_rows_blocks_matmul"):
        real = getattr(block_weights, name)
        monkeypatch.setattr(block_weights, name, lambda *a, name=name, real=real: calls.append((name, a[0].shape))
                            or real(*a))
    with torch.inference_mode():
        for rows in (1, 10, block_weights.FEW_ROWS):
            x = torch.randn(1, rows, 64)
            y = layer(x)
            assert y.shape == (1, rows, 96) and torch.allclose(y, linear(x), atol=1e-5)
        prompt = torch.randn(1, block_weights.FEW_ROWS + 1, 64)
        assert torch.equal(layer(prompt), linear(prompt))
    assert calls == [("blockwise_matmul", (1, 64)), ("few_rows_blocks_matmul", (10, 64)),
                     ("few_rows_blocks_matmul", (block_weights.FEW_ROWS, 64))]
    assert layer.weight is linear.weight  # the same Parameter: ties and state_dict keys unchanged


@needs_kernels
@pytest.mark.parametrize("rows, inputs, outputs", [(18, 576, 960), (7, 64, 33), (2, 1536, 16), (64, 8, 100)])
def test_few_rows_kernel_matches_the_fp32_product(rows, inputs, outputs):
    """kernels/few_rows.c's x @ W^T for any number of rows (blocks of 6) and outputs (tiles of 16) agrees with the
    product in fp64 to fp32 rounding; an input size it does not take (not a multiple of 8) goes to F.linear."""
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, inputs), torch.randn(outputs, inputs)
    expected = x.double() @ weight.double().T
    got = block_weights.few_rows_matmul(x, weight)
    assert got.shape == (rows, outputs)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    odd, odd_weight = torch.randn(rows, 12), torch.randn(outputs, 12)
    assert torch.equal(block_weights.few_rows_matmul(odd, odd_weight), torch.nn.functional.linear(odd, odd_weight))


@needs_kernels
@pytest.mark.parametrize("make", [four_bit_weight, eight_bit_weight])
@pytest.mark.parametrize("wide", [True, False])
def test_few_rows_from_blocks_give_the_bits_of_few_rows_from_the_fp32_weights(make, wide, vector_width):
    """linear_rows_blocks decodes each tile of outputs from the blocks to the very fp32 weights, then multiplies
    as linear_rows does: bit for bit its result, with either vector width, for outputs that leave a part-filled
    tile; a shape it does not take (inputs not a multiple of 32) is refused, not guessed."""
    if wide and not vector_width(True):
        pytest.skip("this CPU lacks AVX-512")
    vector_width(wide)
    for rows, inputs, outputs in ((25, 576, 203), (7, 1536, 77), (64, 32, 16)):
        weight = make(outputs, inputs, seed=rows)
        blocks = exact_blocks(weight)
        x = torch.randn(rows, inputs)
        got = block_weights.few_rows_blocks_matmul(x, blocks, outputs)
        assert torch.equal(got, block_weights.few_rows_matmul(x, weight))
        assert torch.allclose(got, x @ weight.T, atol=1e-4)
    odd = block_weights.Blocks(blocks.bits, blocks.codes, blocks.scale, blocks.minimum)
    assert block_weights.few_rows_blocks_matmul(torch.randn(3, 48), odd, outputs) is None


@needs_kernels
@pytest.mark.parametrize("tied", [False, True])
def test_model_on_blocks_answers_token_for_token_as_in_fp32(tied):
    from snapkv.compression.config import Cut

    model = build_tiny("llama-gqa")
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.get_input_embeddings().weight
    snap_to_blocks(model)
    ids = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(1))
    question = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(2))
    expected = {}
    for label, cut in (("full", None), ("cut", Cut(64, 8))):
        cache = prefill(model, ids, None)
        expected[label] = list(answer(model, cache, question, per_question=cut, max_new_tokens=24))
    fp32_bytes = weight_bytes_per_token(model)
    report = use_block_weights(model)
    linears = 3 * 7 + 1  # tied or not, the output head is a linear layer (over the input table when tied)
    assert report.packed == linears and report.reason is None
    assert sum(isinstance(module, BlockLinear) for module in model.modules()) == linears
    assert weight_bytes_per_token(model) < fp32_bytes
    if tied:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    for label, cut in (("full", None), ("cut", Cut(64, 8))):
        cache = prefill(model, ids, None)
        assert list(answer(model, cache, question, per_question=cut, max_new_tokens=24)) == expected[label]


def test_float_weights_and_unavailable_kernels_leave_the_model_as_it_was(monkeypatch):
    model = build_tiny("llama-gqa")  # random fp32: not blocks
    report = use_block_weights(model)
    assert report.packed == 0
    assert report.reason == (native.unavailable_reason() or "no linear layer's weights are exact 4/8-bit blocks")
    monkeypatch.setenv(native.SETTING, "off")
    snap_to_blocks(model)
    report = use_block_weights(model)
    assert report.packed == 0 and f"{native.SETTING}=off" in report.describe()
    assert not any(isinstance(module, BlockLinear) for module in model.modules())


def test_a_missing_compiler_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(native.NativeUnavailable, match="C compiler"):
        native.kernels()
    assert "C compiler" in native.unavailable_reason()  # remembered: not tried again per call
    assert not list((tmp_path / "home" / "native").glob("*.so"))


def test_a_compile_error_is_a_reason_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ("-DSNAPKV_BROKEN", "-include", "no_such_header.h"))
    with pytest.raises(native.NativeUnavailable, match="compiling"):
        native.kernels()
    folder = tmp_path / "home" / "native"
    assert not folder.exists() or not any(folder.iterdir())


@pytest.mark.slow
def test_embedded_model_decodes_from_its_gguf_blocks(embedded):
    if embedded.dtype != torch.float32 or native.unavailable_reason():
        assert embedded.weights == "as loaded" or embedded.weights.startswith("fp32 weights (")
        pytest.skip(f"blocks are for fp32 on CPU with the kernels ({embedded.dtype}, {native.unavailable_reason()})")
    assert embedded.weights.startswith("211 of 211 linear layers"), embedded.weights
    assert weight_bytes_per_token(embedded.model) < 120 * 2**20  # 513 MiB in fp32


@needs_kernels
def test_blocks_found_once_are_read_back_beside_the_same_weight_files(tmp_path, monkeypatch):
    """A converted model's blocks are saved beside its weight files and read back on the next load (nothing
    found again); changed weight files, a saved matrix that does not match its weight, or a damaged file
    make them found again and saved anew, with the same blocks."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")  # the stamp reads its name, size and time

    def fresh_model():
        model = build_tiny("llama-gqa")
        snap_to_blocks(model)
        return model

    first = use_block_weights(fresh_model(), saved_in=folder)
    saved = folder / block_weights.SAVED_NAME
    assert first.packed == 22 and saved.is_file()
    searches = []
    real = block_weights.exact_blocks
    monkeypatch.setattr(block_weights, "exact_blocks", lambda weight: searches.append(1) or real(weight))
    model = fresh_model()
    assert use_block_weights(model, saved_in=folder) == first and not searches  # read back, nothing searched
    reference = fresh_model()
    use_block_weights(reference)
    read_back = {name: module.blocks for name, module in model.named_modules() if isinstance(module, BlockLinear)}
    for name, module in reference.named_modules():
        if isinstance(module, BlockLinear):
            mine = read_back.pop(name)
            assert mine.bits == module.blocks.bits and torch.equal(mine.codes, module.blocks.codes)
            assert torch.equal(mine.scale, module.blocks.scale)
            assert (mine.minimum is None) == (module.blocks.minimum is None)
            assert mine.minimum is None or torch.equal(mine.minimum, module.blocks.minimum)
    assert not read_back
    searches.clear()  # the reference's own search

    (folder / "model.safetensors").write_bytes(b"other weights")  # a new conversion: the stamp differs
    assert use_block_weights(fresh_model(), saved_in=folder) == first and len(searches) == 22
    searches.clear()
    changed = fresh_model()
    with torch.no_grad():
        changed.model.layers[0].mlp.up_proj.weight.mul_(2)  # still blocks, but not the saved ones
    assert use_block_weights(changed, saved_in=folder) == first and len(searches) == 1
    assert torch.equal(block_weights.unpacked(changed.model.layers[0].mlp.up_proj.blocks),
                       changed.model.layers[0].mlp.up_proj.weight)
    searches.clear()
    saved.write_bytes(b"not a safetensors file")
    assert use_block_weights(fresh_model(), saved_in=folder) == first and len(searches) == 22
    searches.clear()
    assert use_block_weights(fresh_model(), saved_in=folder) == first and not searches  # saved anew

    # a file that reads but does not fit: a scale in fp16 (the kernel reads fp32), a layer whose name it
    # never examined (renamed modules): those are searched again, and the file saved anew
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(saved), framework="pt") as handle:
        metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    name = "model.layers.1.self_attn.o_proj"
    tensors[f"{name}.scale"] = tensors[f"{name}.scale"].half()
    examined = json.loads(metadata["examined"])
    examined.remove("lm_head")
    layers = [layer for layer in json.loads(metadata["layers"]) if layer != "lm_head"]
    del tensors["lm_head.codes"], tensors["lm_head.scale"]
    tensors.pop("lm_head.minimum", None)
    save_file(tensors, str(saved), metadata={**metadata, "examined": json.dumps(examined), "layers": json.dumps(layers)})
    searches.clear()
    assert use_block_weights(fresh_model(), saved_in=folder) == first and len(searches) == 2
    searches.clear()
    assert use_block_weights(fresh_model(), saved_in=folder) == first and not searches


@needs_kernels
def test_fused_projections_decode_the_same_in_fewer_kernel_calls(monkeypatch):
    """q/k/v and gate/up blocks are fused into one tensor each (the BlockLinears keep views of their rows): the
    lean decode step reads each group in one kernel call and gives the same logits, to the bit, as calling
    the projections one by one."""
    from snapkv.engine import lean_decode, torch_question

    model = build_tiny("llama-gqa")
    snap_to_blocks(model)
    fp32_bytes = weight_bytes_per_token(model)
    use_block_weights(model)
    layers = model.model.layers
    attention = layers[0].self_attn
    fused = attention.__dict__[block_weights.FUSED][("q_proj", "k_proj", "v_proj")]
    assert attention.q_proj.blocks.codes.data_ptr() == fused.codes.data_ptr()  # a view, not a copy
    assert weight_bytes_per_token(model) < fp32_bytes
    cache = prefill(model, torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(4)), None)
    calls = []

    def each_way(run) -> dict:
        """run(a working cache) with the q/k/v and gate/up blocks fused, then taken apart: what it gave, and the kernel
        calls it made, by label."""
        found = {}
        for label in ("fused", "one by one"):
            if label == "one by one":
                for module in model.modules():
                    module.__dict__.pop(block_weights.FUSED, None)
            calls.clear()
            found[label] = run(WorkingCache.of(cache, model.config))
            found[label + " calls"] = len(calls)
        return found

    real = block_weights.blockwise_matmul
    monkeypatch.setattr(block_weights, "blockwise_matmul", lambda *a: calls.append(a[2]) or real(*a))
    found = each_way(lambda working: lean_decode.decode_step(model, 7, 40, working))
    assert torch.equal(found["fused"], found["one by one"])
    assert found["fused calls"] == 4 * len(layers) + 1 and found["one by one calls"] == 7 * len(layers) + 1
    # a question's rows: the same in one few-rows kernel call per group, through the lean question pass
    from snapkv.compression.compress import CompressionPlan
    from snapkv.compression.config import Cut

    use_block_weights(model)  # fused again
    question = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(5))
    real_rows = block_weights.few_rows_blocks_matmul
    monkeypatch.setattr(block_weights, "few_rows_blocks_matmul", lambda *a: calls.append(a[2]) or real_rows(*a))

    def question_pass(working):
        plan = CompressionPlan(Cut(16, 4), window=9)
        return torch_question.question_pass(model, question, 40, working, plan), plan.kept

    found = each_way(question_pass)
    (fused, fused_kept), (apart, apart_kept) = found["fused"], found["one by one"]
    assert torch.equal(fused, apart)
    assert all(torch.equal(fused_kept[i], apart_kept[i]) for i in range(len(layers)))
    # per layer one more call each way: the cut scores the window's queries again (q_proj), as sdpa kept no weights
    assert found["fused calls"] == 5 * len(layers) + 1 and found["one by one calls"] == 8 * len(layers) + 1
