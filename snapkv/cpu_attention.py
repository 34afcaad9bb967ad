"""Attention for one decoded token on a CPU in 16 bits: two small matmuls instead of PyTorch's sdpa kernel.

On CPU, sdpa's flash kernel in bf16 is slow for a single query: measured on a 2-core CPU with AVX512-BF16
(9 query heads, 3 KV heads, head_dim 64), one call took 575 us over 1024 cached positions and 3963 us over
7000, where q @ K^T, a softmax in fp32 and @ V as plain bf16 matmuls took 101 and 266 us. In fp32 sdpa is as
fast as the matmuls, and on GPUs its kernels are the right ones, so everything else goes to sdpa unchanged:
more than one query (the prompt, the question), fp32, other devices, masks other than one row, soft-capping,
attention sinks, dropout.

Registered with transformers under NAME (with sdpa's mask), and picked by snapkv.models on CPU.
"""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "snapkv_cpu_decode"
SIXTEEN_BITS = (torch.bfloat16, torch.float16)
UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")


def _plain_decode(query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, kwargs: dict) -> bool:
    """One query row on CPU in 16 bits, grouped heads that divide evenly, nothing sdpa-specific asked for."""
    single_row_mask = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1))
    return (query.shape[2] == 1 and query.device.type == "cpu" and query.dtype in SIXTEEN_BITS
            and query.shape[1] % key.shape[1] == 0 and single_row_mask and not dropout
            and not kwargs.get("output_attentions") and all(kwargs.get(name) is None for name in UNSUPPORTED))


def decodes_by_matmuls(model, keys: torch.Tensor) -> bool:
    """Whether `model`, decoding against cached `keys`, takes this module's matmul path."""
    return (getattr(model.config, "_attn_implementation", None) == NAME and keys.device.type == "cpu"
            and keys.dtype in SIXTEEN_BITS)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature. query: (batch, heads, q, head_dim); key, value: (batch, kv_heads, n,
    head_dim). Returns (batch, q, heads, head_dim), as sdpa_attention_forward does."""
    if not _plain_decode(query, key, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else head_dim**-0.5
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # the query heads of each KV head
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scale  # (batch, kv_heads, group, n)
    if attention_mask is not None:  # (batch, 1, 1, n): True / 0 where attended
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask.float()
    weights = scores.softmax(dim=-1).to(value.dtype)
    output = torch.matmul(weights, value)  # (batch, kv_heads, group, head_dim)
    return output.reshape(batch, 1, heads, head_dim), None


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
