"""Products and lookups over a GGUF file's own blocks (snapkv/native/kernels/gguf_blocks.c): every type's weights exactly
as gguf-py dequantizes them, and products with them within fp32 rounding, on random blocks (every bit pattern of the
codes and 6-bit scales)."""

import pytest
import torch
from gguf_samples import BLOCK_TYPES, gguf_py_weights, random_blocks

from snapkv import native
from snapkv.modeling.gguf_file import TENSOR_TYPES
from snapkv.modeling.gguf_weights import GGUFEmbedding, GGUFLinear, GGUFMatrix

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"no kernels: {native.unavailable_reason()}")
TYPE_IDS = {name: type_id for type_id, (name, _, _) in TENSOR_TYPES.items()}


def _matrix(type_name: str, rows: int, k: int, seed: int) -> tuple[GGUFMatrix, torch.Tensor]:
    blocks = random_blocks(type_name, rows, k, torch.Generator().manual_seed(seed))
    return GGUFMatrix(TYPE_IDS[type_name], type_name, blocks, rows, k), gguf_py_weights(type_name, blocks)


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_every_type_dequantizes_to_gguf_pys_values_bit_for_bit(type_name, wide, vector_width):
    vector_width(wide)  # the 16-lane weights of Q4_K, Q6_K and Q8_0, and the scalar ones of every type
    matrix, expected = _matrix(type_name, 7, 512, seed=len(type_name))
    assert torch.equal(matrix.dequantized(), expected)
    assert torch.equal(matrix.dequantized(torch.bfloat16), expected.to(torch.bfloat16))  # rounded as PyTorch rounds


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_products_over_the_blocks_agree_with_the_dequantized_weights(type_name, rows, wide, vector_width):
    vector_width(wide)
    matrix, weights = _matrix(type_name, 37, 768, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(5))
    expected = (x.double() @ weights.double().T).float()
    found = matrix.times(x)
    torch.testing.assert_close(found, expected, rtol=2e-5, atol=2e-5 * expected.abs().max().item())


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_an_embedding_looks_up_the_dequantized_rows_and_refuses_ids_out_of_range(type_name):
    matrix, weights = _matrix(type_name, 50, 256, seed=3)
    embedding = GGUFEmbedding(matrix)
    ids = torch.tensor([[0, 49, 7], [7, 3, 0]])
    assert torch.equal(embedding(ids), weights[ids])
    with pytest.raises(IndexError):
        embedding(torch.tensor([50]))
    with pytest.raises(IndexError):
        embedding(torch.tensor([-1]))


def test_a_linear_layer_over_blocks_takes_few_rows_from_the_blocks_and_many_from_a_dequantized_tile():
    matrix, weights = _matrix("Q4_K", 24, 256, seed=9)
    bias = torch.randn(24)
    linear = GGUFLinear(matrix, bias)
    for rows in (1, 80):  # 80: more than the kernel's rows, a tile in fp32
        x = torch.randn(2, rows, 256)
        expected = x.double() @ weights.double().T + bias.double()
        torch.testing.assert_close(linear(x).double(), expected, rtol=1e-5, atol=1e-4)
    x = torch.randn(1, 80, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the prefill's products: bf16 tiles of the same weights
        found = linear(x)
    assert found.dtype == torch.bfloat16
    expected = torch.nn.functional.linear(x.bfloat16(), weights.bfloat16(), bias.bfloat16())
    assert torch.equal(found, expected)


def test_shapes_the_kernels_do_not_take_are_refused():
    library = native.kernels()
    blocks = random_blocks("Q4_K", 2, 256, torch.Generator().manual_seed(0))
    x, y = torch.randn(1, 200), torch.empty(1, 2)
    pointer = native.pointer
    # 200 inputs are not whole blocks of 256; type 99 is not one the kernels read
    assert library.gguf_matmul(pointer(x, torch.float32), 1, 200, TYPE_IDS["Q4_K"], pointer(blocks, torch.uint8),
                               144, 2, pointer(y, torch.float32), 1) == -1
    assert library.gguf_matmul(pointer(x, torch.float32), 1, 256, 99, pointer(blocks, torch.uint8), 144, 2,
                               pointer(y, torch.float32), 1) == -1
