"""The memory-bandwidth floor of decoding: each new token reads the weights and the kept KV once.

floor (s/token) = (weight bytes read per token + KV bytes read per token) / read bandwidth
"""

import time

import torch

from snapkv.engine.memory import wait_for_device


def weight_bytes_per_token(model) -> int:
    """Bytes of parameters a decoded token reads: every weight once, except the input embedding table,
    of which one row is read (unless the output head shares it, which reads it whole); a layer that decodes
    from 4/8-bit blocks (snapkv.modeling.block_weights) reads its blocks instead of its fp32 weight."""
    from snapkv.modeling.block_weights import BlockLinear
    from snapkv.modeling.gguf_weights import GGUFEmbedding

    if isinstance(model.get_input_embeddings(), GGUFEmbedding):
        return _gguf_bytes_per_token(model)
    seen, total = set(), 0
    for parameter in model.parameters():
        if parameter.data_ptr() in seen:
            continue
        seen.add(parameter.data_ptr())
        total += parameter.numel() * parameter.element_size()
    embedding = model.get_input_embeddings().weight
    row = embedding.shape[1] * embedding.element_size()
    head = model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != embedding.data_ptr():
        total -= embedding.numel() * embedding.element_size() - row
    for module in model.modules():
        if isinstance(module, BlockLinear):
            total += module.blocks.nbytes - module.weight.numel() * module.weight.element_size()
            if module.weight.data_ptr() == embedding.data_ptr():
                total += row  # the table is still read, one row, by the input embedding
    return total


def _gguf_bytes_per_token(model) -> int:
    """weight_bytes_per_token of a model read in a GGUF file's own blocks (snapkv.modeling.gguf_weights): every
    projection's blocks once (the head's too, the embeddings' own where tied), one row of the embeddings' blocks,
    and the small float parameters (norms, biases)."""
    from snapkv.modeling.gguf_weights import GGUFLinear

    total = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    seen = set()
    for module in model.modules():
        if isinstance(module, GGUFLinear) and module.matrix.blocks.data_ptr() not in seen:
            seen.add(module.matrix.blocks.data_ptr())
            total += module.matrix.nbytes
    return total + model.get_input_embeddings().matrix.blocks.shape[1]


@torch.inference_mode()
def read_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second this process reads from memory: the best of `repeats` sums over a buffer far larger
    than any cache (a sum is one read per element and little arithmetic)."""
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)  # (n,)
    buffer.sum()  # touch it once: pages mapped, kernels loaded
    best = float("inf")
    for _ in range(repeats):
        wait_for_device(device)
        started = time.perf_counter()
        buffer.sum()
        wait_for_device(device)
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * buffer.element_size() / best


def floor_ms_per_token(weight_bytes: int, kv_bytes: int, bandwidth: float) -> float:
    return 1000 * (weight_bytes + kv_bytes) / bandwidth
