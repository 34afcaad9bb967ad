"""Attention for a few queries on a CPU (a decoded token, a question): two small matmuls instead of
PyTorch's sdpa kernel.

On CPU, sdpa's flash kernel in bf16 is slow for a single query: measured on a 2-core CPU with AVX512-BF16
(9 query heads, 3 KV heads, head_dim 64), one call took 575 us over 1024 cached positions and 3963 us over
7000, where q @ K^T, a softmax in fp32 and @ V as plain bf16 matmuls took 101 and 266 us; a question of up to
SHORT_QUERY tokens over a long cache gains the same way. In fp32 a question gains too (20 rows over 7188 keys:
15.2 ms against sdpa's 21.9, which first repeats each KV head for its query heads), while one decoded row
does not (sdpa 1.80 ms, matmuls 1.94 over 7168 keys), so one fp32 row stays with sdpa. A question's fp32 rows
go further still where the C kernels are available (snapkv.native): snapkv/native/kernels/few_rows.c computes scores,
softmax and the weighted values in one call (register tiles; PyTorch's matmuls reach about half this CPU's
fp32 rate on 60 rows by 64 channels; 8.2 against 11.9 ms per layer for 18 rows over 8000 keys). On GPUs sdpa's
kernels are the right ones, so everything else goes to sdpa unchanged: longer queries (the prompt), other
devices, a causal query block without a mask, soft-capping, attention sinks, dropout.

Registered with transformers under NAME (with sdpa's mask), and picked by snapkv.engine.models on CPU.
"""

import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from snapkv import native
from snapkv.native.threads import threads_now

NAME = "snapkv_cpu_decode"
SIXTEEN_BITS = (torch.bfloat16, torch.float16)
SHORT_QUERY = 64  # at most this many query rows take the matmuls: a question; a prompt's block goes to sdpa
UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")
NATIVE_HEAD_DIMS = range(16, 257, 16)  # what snapkv/native/kernels/few_rows.c takes
# A module with CAPTURE set to a window of w rows (snapkv.compression.compress, while it cuts a cache) gets its fp32 attention
# weights kept as CAPTURED (a Captured), so that scoring the window need not compute them again.
CAPTURE, CAPTURED = "snapkv_capture_weights", "snapkv_captured_weights"


@dataclass
class Captured:
    """A question's attention weights, kept for the cut that follows: the weights themselves (PyTorch's matmuls), or
    their sums over the window's rows (snapkv/native/kernels/few_rows.c, which adds each row in as it leaves the softmax).

    weights:     (batch, kv_heads, group, q, n) fp32, softmax over all n keys, causal among the q rows; or None
    window:      the observation window: the question's last `window` rows (at most q)
    window_sums: (batch, kv_heads, group, n) the weights summed over the window's rows, or None
    """

    weights: torch.Tensor | None
    window: int
    window_sums: torch.Tensor | None = None


def _plain_decode(query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, kwargs: dict) -> bool:
    """A few query rows on CPU (in fp32 more than one) with a mask row per query (none needed for one), grouped
    heads that divide evenly, nothing sdpa-specific asked for."""
    rows = query.shape[2]
    if attention_mask is None:
        mask_fits = rows == 1  # sdpa makes several rows causal by itself
    else:
        mask_fits = attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, rows)
    dtype_fits = query.dtype in SIXTEEN_BITS or (query.dtype == torch.float32 and rows > 1)
    return (rows <= SHORT_QUERY and mask_fits and query.device.type == "cpu" and dtype_fits
            and query.shape[1] % key.shape[1] == 0 and not dropout
            and not kwargs.get("output_attentions") and all(kwargs.get(name) is None for name in UNSUPPORTED))


def _attended(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask (batch, 1, q, n), bool or additive, as a bool: True where attended."""
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0


def _question_columns(attention_mask: torch.Tensor) -> int:
    """Where the columns that need masking start: n - q when every row attends to all of the first n - q keys (a
    question after its cache), else 0."""
    return _read_mask(attention_mask)[0]


def _causal_after_prefix(attention_mask: torch.Tensor) -> bool:
    """Whether every row attends to all of the first n - q keys and its own columns are causal (row i sees the
    block's keys 0..i): a prompt's block after the cache it extends (a chunk of a chunked prefill, a prompt after its
    saved prefix)."""
    return _read_mask(attention_mask)[1]


def _read_mask(attention_mask: torch.Tensor) -> tuple[int, bool]:
    """(_question_columns, _causal_after_prefix) of attention_mask (batch, 1, q, n), read once per mask while it lives
    and is unchanged (a forward passes the same mask to every layer: 30 reads of q x n entries otherwise); a tensor
    made under inference_mode keeps no count of its changes, and is taken as the forward made it (transformers'
    masks are never changed in place)."""
    remembered, version, answer = _last_mask
    if remembered() is attention_mask and _version_of(attention_mask) == version:
        return answer
    rows, n = attention_mask.shape[-2:]
    attended = _attended(attention_mask)
    columns = n - rows if rows < n and bool(attended[..., : n - rows].all()) else 0
    causal = bool(columns and rows > 1 and attention_mask.shape[0] == 1
                  and _lower_triangular(attended[0, 0, :, columns:]))
    _last_mask[:] = [weakref.ref(attention_mask), _version_of(attention_mask), (columns, causal)]
    return columns, causal


def _lower_triangular(square: torch.Tensor, block: int = 1024) -> bool:
    """Whether square (q, q) bool is True exactly on and below its diagonal; read `block` rows at a time, so that no
    second q x q tensor is made."""
    rows = square.shape[0]
    columns = torch.arange(rows, device=square.device)
    for start in range(0, rows, block):
        band = square[start:start + block]  # (b, q)
        expected = columns <= torch.arange(start, start + band.shape[0], device=square.device).unsqueeze(1)
        if not torch.equal(band, expected):
            return False
    return True


# _read_mask's memory: a weak reference to the last mask read, its version, the answer
_last_mask: list = [lambda: None, None, (0, False)]


def _version_of(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def _apply_mask(scores: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """In place: scores (batch, kv_heads, group, q, n) masked by attention_mask (batch, 1, q, n), True / 0
    where attended. Where every row attends to all of the first n - q keys, only the last q columns are touched."""
    mask = attention_mask[..., _question_columns(attention_mask):].unsqueeze(1)  # (batch, 1, 1, q, n - start)
    tail = scores[..., -mask.shape[-1]:]
    if mask.dtype == torch.bool:
        tail.masked_fill_(~mask, float("-inf"))
    else:
        tail.add_(mask.float())


def _attend_natively(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                     scale: float, window: int = 0) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A question's fp32 rows through snapkv/native/kernels/few_rows.c: (output (kv_heads, group * q, head_dim), the
    softmax summed over each query head's last `window` rows (kv_heads, group, n) or None for window 0), or None
    where it does not apply (a batch, a layout or head size it does not take, earlier columns masked, the kernels
    unavailable). query (1, heads, q, head_dim); key, value (1, kv_heads, n, head_dim), each head's rows contiguous;
    attention_mask (1, 1, q, n)."""
    _, heads, rows, head_dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    if (query.shape[0] != 1 or rows < 2 or head_dim not in NATIVE_HEAD_DIMS or attention_mask is None
            or any(t.dtype != torch.float32 or t.stride(-1) != 1 or t.stride(-2) != head_dim for t in (key, value))
            or native.unavailable_reason() is not None or _question_columns(attention_mask) != n - rows):
        return None
    tail = attention_mask[0, 0, :, n - rows:]  # (q, q): the question's own columns
    tail = (torch.zeros(rows, rows).masked_fill_(~tail, float("-inf")) if tail.dtype == torch.bool
            else tail.float().contiguous())
    query = query.contiguous()
    weights = torch.empty(kv_heads, heads // kv_heads * rows, n)  # the kernel's room for scores and numerators
    output = torch.empty(kv_heads, heads // kv_heads * rows, head_dim)
    window = min(window, rows)
    sums = torch.empty(kv_heads, heads // kv_heads, n) if window else None
    fp32 = torch.float32
    status = native.kernels().attend_rows(
        native.pointer(query, fp32), kv_heads, heads // kv_heads * rows, rows, scale,
        native.pointer(key, fp32, strided=True), key.stride(1), native.pointer(value, fp32, strided=True),
        value.stride(1), n, head_dim, native.pointer(tail, fp32, (rows, rows)), native.pointer(weights, fp32),
        native.pointer(output, fp32), window, None if sums is None else native.pointer(sums, fp32),
        threads_now())
    return (output, sums) if status == 0 else None


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)  # (output, logsumexp)


def _block_after_prefix(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, dropout: float,
                        kwargs: dict) -> bool:
    """A prompt's block of more than SHORT_QUERY rows on CPU in fp32 whose mask is all of the cache before it plus
    causal over its own keys, nothing sdpa-specific asked for (see _attend_block_after_prefix). Not in bf16 (nor
    under CPU autocast, where sdpa computes in bf16): there the two outputs are rounded to bf16 before they are
    joined, and chunked prefills of samples/city_transport_review.txt changed 3 of 12 answers that way (2 of 12 with
    the join in fp32), against none of 46 in fp32."""
    return (_FLASH is not None and attention_mask is not None and attention_mask.dim() == 4
            and query.shape[0] == 1 and query.shape[2] > SHORT_QUERY and query.device.type == "cpu"
            and not torch.is_autocast_enabled("cpu") and query.dtype == key.dtype == value.dtype == torch.float32
            and query.shape[1] % key.shape[1] == 0
            and attention_mask.shape[1:] == (1, query.shape[2], key.shape[2]) and not dropout
            and not kwargs.get("output_attentions") and all(kwargs.get(name) is None for name in UNSUPPORTED)
            and _causal_after_prefix(attention_mask))


def _attend_block_after_prefix(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               scaling: float | None) -> torch.Tensor:
    """sdpa's result for a block of q rows after p cached keys, in two unmasked calls of its flash kernel: the rows
    over the p earlier keys (every query head of a KV head as one run of rows: no repeated keys), and over their own
    q keys with the kernel's causal flag (which skips the masked half); the two softmaxes joined by their
    log-sum-exps. With a mask, sdpa's CPU kernel turns it into an additive one in every layer and computes every
    masked score: measured on a 2-core AMD EPYC (AVX-512), 4096 rows after 8192 keys (9 query heads, 3 KV heads,
    head_dim 64), one layer took 0.65 s against sdpa's 0.96 in fp32, the AVX2 build alike; the results agree to fp32
    rounding (6e-8 apart), not bit for bit.

    query (1, heads, q, head_dim); key, value (1, kv_heads, p + q, head_dim). Returns (1, q, heads, head_dim)."""
    _, heads, rows, head_dim = query.shape
    kv_heads, earlier = key.shape[1], key.shape[2] - query.shape[2]
    group = heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    grouped = query.reshape(1, kv_heads, group * rows, head_dim)  # each KV head's query heads, rows one after another
    before, before_lse = _FLASH(grouped, key[:, :, :earlier], value[:, :, :earlier], 0.0, False, scale=scale)
    before = before.reshape(1, heads, rows, head_dim)
    before_lse = before_lse.reshape(1, heads, rows, 1)  # fp32
    own_keys, own_values = (t[:, :, earlier:].repeat_interleave(group, dim=1) for t in (key, value))
    own, own_lse = _FLASH(query, own_keys, own_values, 0.0, True, scale=scale)  # (1, heads, q, head_dim), (1, heads, q)
    own_lse = own_lse.reshape(1, heads, rows, 1)
    total = torch.logaddexp(before_lse, own_lse)  # (1, heads, q, 1)
    output = before * (before_lse - total).exp_() + own * (own_lse - total).exp_()
    return output.transpose(1, 2).contiguous()


def decodes_by_matmuls(model, keys: torch.Tensor) -> bool:
    """Whether `model`, decoding against cached `keys`, takes this module's matmul path."""
    return (getattr(model.config, "_attn_implementation", None) == NAME and keys.device.type == "cpu"
            and keys.dtype in SIXTEEN_BITS)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature. query: (batch, heads, q, head_dim); key, value: (batch, kv_heads, n,
    head_dim); attention_mask (batch, 1, q, n) or None. Returns (batch, q, heads, head_dim), as
    sdpa_attention_forward does."""
    if not _plain_decode(query, key, attention_mask, dropout, kwargs):
        if _block_after_prefix(query, key, value, attention_mask, dropout, kwargs):
            return _attend_block_after_prefix(query, key, value, scaling), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, rows, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    window = min(getattr(module, CAPTURE, 0), rows)  # for snapkv.compression.compress's scoring, where it cuts this layer
    natively = (_attend_natively(query, key, value, attention_mask, scale, window) if query.dtype == torch.float32
                else None)
    if natively is not None:
        (output, sums), weights = natively, None
    else:
        (output, weights), sums = _attend_by_matmuls(query, key, value, attention_mask, scale), None
    if window and query.dtype == torch.float32:
        setattr(module, CAPTURED, Captured(None if weights is None else weights.view(batch, kv_heads, group, rows, -1),
                                           window, None if sums is None else sums.view(batch, kv_heads, group, -1)))
    return output.view(batch, heads, rows, head_dim).transpose(1, 2).contiguous(), None


def _attend_by_matmuls(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (batch, kv_heads, group * q, head_dim), weights (batch, kv_heads, group * q, n)) by PyTorch's
    matmuls; weights in fp32."""
    batch, heads, rows, head_dim = query.shape
    kv_heads = key.shape[1]
    # the query heads of each KV head, their rows one after another: (batch, kv_heads, group * q, head_dim)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * rows, head_dim)
    if query.dtype == torch.float32:  # scaled on the few query rows rather than on every score
        scores = torch.matmul(grouped * scale, key.transpose(-1, -2))  # (batch, kv_heads, group * q, n)
    else:  # 16 bits: the products rounded once, then scaled in fp32
        scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scale
    if attention_mask is not None:  # (batch, 1, q, n): True / 0 where attended
        _apply_mask(scores.view(batch, kv_heads, heads // kv_heads, rows, -1), attention_mask)
    weights = scores.softmax(dim=-1)
    return torch.matmul(weights.to(value.dtype), value), weights


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
