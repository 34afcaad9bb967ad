"""A question's attention over a saved layer read straight from its codes, for the native engine's question pass
(snapkv.engine.native_question).

Over a deferred cache (snapkv.storage.deferred) the pass restored each layer to fp32 (8k tokens of the embedded model: 12 MB
of keys and values a layer, ~40 ms of a question over 30 layers), attended over it, then kept ~1/8 of it. Here one C
call per layer (snapkv/native/kernels/coded_attention.c's attend_coded) attends over the stored codes themselves,
decoding each tile of 64 keys or values into the nearest cache as it goes (the Hadamard rotation moved onto the few
query and output rows), and sums the window's softmax per query head as the CPU attention does for SnapKV's score
(snapkv.modeling.cpu_attention.Captured). The cut that follows is the torch engine's own
(snapkv.compression.compress.cut_layer): it scores from those sums, picks the positions, and the layer, which still
holds its codes and the question's rows apart, restores only those (the same bits as the whole layer's restore). The
output and the sums agree with the restored path's within fp32 rounding (tests/test_coded_attention.py: the same
positions kept).

Taken where everything fits (the native engine's question pass asked for it): fp32 on a CPU
with AVX-512 and snapkv's kernels, their 16-lane functions in use (wide_vectors(): by default only in the avx512 build;
the others run those functions in plain C, and there the restored path measured 4.6x faster: 0.145 s against 0.66 for
a follow-up's first token at 6.6k tokens on the AVX2 build; tests turn them on to check this path on every build);
SnapKV's method or its chunks; a layer the plan cuts, stored below 16 bits as one part or as a sharper share whose keys
and values share their sharper positions; keys grouped along tokens and values along channels, in groups of a multiple
of 16; every value part rotated alike; head_dim a multiple of 64 (up to 256). Anything else returns None, and the pass
restores the layer as before.
"""

import ctypes

import torch

from snapkv import native
from snapkv.compression.compress import CompressionPlan
from snapkv.compression.methods import Chunks, SnapKV
from snapkv.modeling import cpu_attention
from snapkv.native.threads import threads_now
from snapkv.storage.deferred import RestoringLayer
from snapkv.storage.quantize import CHANNELS, TOKENS, Mixed, Quantized

READABLE_BITS = (2, 3, 4, 8)


def _parts(stored_keys, stored_values) -> list[tuple[Quantized, Quantized]] | None:
    """The (keys, values) parts in the order their columns are read, or None where they do not pair up."""
    if isinstance(stored_keys, Quantized) and isinstance(stored_values, Quantized):
        return [(stored_keys, stored_values)]
    if (isinstance(stored_keys, Mixed) and isinstance(stored_values, Mixed)
            and (stored_keys.sharp is stored_values.sharp or torch.equal(stored_keys.sharp, stored_values.sharp))):
        return [(stored_keys.high, stored_values.high), (stored_keys.low, stored_values.low)]
    return None


def _readable(parts: list[tuple[Quantized, Quantized]], head_dim: int) -> bool:
    """Whether coded_attention.c reads these parts (its conditions, checked here so that it never refuses)."""
    if (head_dim % 64 or head_dim > native.limit("snapkv_max_attention_head_dim")
            or len({values.scheme.rotated for _, values in parts}) != 1):
        return False
    for keys, values in parts:
        key_scheme, value_scheme = keys.scheme, values.scheme
        if (key_scheme.axis != TOKENS or value_scheme.axis != CHANNELS or key_scheme.group % 16
                or value_scheme.group % 16 or head_dim % value_scheme.group or keys.shape[1] == 0
                or key_scheme.bits not in READABLE_BITS or value_scheme.bits not in READABLE_BITS):
            return False
        for part in (keys, values):  # read by address: as stored, on the CPU, contiguous
            if (part.packed.dtype != torch.uint8 or part.scale.dtype != torch.float16
                    or part.minimum.dtype != torch.float16
                    or not all(t.device.type == "cpu" and t.is_contiguous()
                               for t in (part.packed, part.scale, part.minimum))):
                return False
    return True


def _pointer_array(values: list[int], kind) -> ctypes.Array:
    return (kind * len(values))(*values)


@torch.inference_mode()
def attend_coded(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: RestoringLayer | None,
                 plan: CompressionPlan) -> torch.Tensor | None:
    """The question's attention output (1, q, heads * head_dim) over `layer` (a deferred layer still in its stored bits:
    WorkingCache.still_stored; None: there is none) and the question's own rows, which the layer then holds after its
    stored positions, still unrestored, with the window's sums kept on the module for the cut that must follow
    (snapkv.compression.compress.cut_layer, which restores only the positions it keeps); None where this path does not
    apply (nothing is changed then).
    query (1, heads, q, head_dim), key and value (1, kv_heads, q, head_dim): the question's rows after RoPE (query,
    key), fp32."""
    method = plan.cut.method
    if (layer is None or not isinstance(method, (SnapKV, Chunks))
            or native.unavailable_reason() is not None or not native.kernels().wide_vectors(-1)):
        return None  # no 16-lane functions in use: in plain C (the avx2 and generic builds) the restored path is faster
    parts = _parts(layer.stored_keys, layer.stored_values)
    _, heads, rows, head_dim = query.shape
    kv_heads, stored, _ = layer.stored_keys.shape
    window = min(plan.window, rows)
    if (parts is None or not _readable(parts, head_dim) or query.shape[0] != 1 or heads % kv_heads
            or any(t.dtype != torch.float32 for t in (query, key, value))
            or stored + rows <= plan.prefix_keep_at(module.layer_idx) + window):  # the cut would keep every position
        return None
    group = heads // kv_heads
    rotated = any(keys.scheme.rotated or values.scheme.rotated for keys, values in parts)
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    output = torch.empty(kv_heads, group * rows, head_dim)  # each KV head's query heads' rows, one after another
    sums = torch.empty(1, kv_heads, group, stored + rows)  # the window's softmax summed, per query head, by position
    pointers = _pointer_array([native.pointer(t, dtype) for keys, values in parts for t, dtype in (
        (keys.packed, torch.uint8), (keys.scale, torch.float16), (keys.minimum, torch.float16),
        (values.packed, torch.uint8), (values.scale, torch.float16), (values.minimum, torch.float16))],
        ctypes.c_void_p)
    shapes = _pointer_array([number for keys, values in parts for number in (
        keys.shape[1], keys.scheme.bits, keys.scheme.group, int(keys.scheme.rotated), values.scheme.bits,
        values.scheme.group)], ctypes.c_int64)
    sharp = layer.stored_keys.sharp.contiguous() if isinstance(layer.stored_keys, Mixed) else None  # (kv_heads, stored)
    fp32, own = torch.float32, (1, kv_heads, rows, head_dim)
    if native.kernels().attend_coded(
            native.pointer(query, fp32, (1, heads, rows, head_dim)), kv_heads, group * rows, rows, module.scaling,
            head_dim, len(parts), pointers, shapes, (head_dim & -head_dim) if rotated else 0,
            int(parts[0][1].scheme.rotated), native.pointer(key, fp32, own), native.pointer(value, fp32, own),
            None if sharp is None else native.pointer(sharp, torch.bool, (kv_heads, stored)), window,
            native.pointer(output, fp32), native.pointer(sums, fp32), threads_now()) != 0:
        return None  # memory ran out: the restored path decides
    layer.hold_question(key, value)
    setattr(module, cpu_attention.CAPTURED, cpu_attention.Captured(None, window, window_sums=sums))
    return output.view(heads, rows, head_dim).transpose(0, 1).reshape(1, rows, heads * head_dim)
