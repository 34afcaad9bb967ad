"""A question's attention and cut over a saved layer read straight from its codes, for snapkv.lean_decode's question pass.

The question's pass over a deferred cache (snapkv.deferred) restored each layer to fp32 (8k tokens of the embedded
model: 12 MB of keys and values a layer, ~40 ms a question over 30 layers), attended over it, then kept ~1/8 of it.
Here snapkv/kernels/coded_attention.c attends over the stored codes themselves, decoding each tile of keys or values
into the nearest cache as it goes (the Hadamard rotation moved onto the few query rows and output rows), and only the
positions the cut keeps are restored (dequantize.c's dequantize_chosen_rows: the same bits as the whole layer's
restore). The attention's result and the window's scores agree with the restored path's within rounding; the cut is
SnapKV's, from the same window sums (snapkv.compress.cut_layer's steps).

Taken where everything fits (fp32 on a CPU with AVX-512 and snapkv's kernels; a layer stored below 16 bits as one part
or a sharper share whose keys and values share their sharper positions; keys grouped along tokens and values along
channels in groups of a multiple of 16; every value part rotated alike; head_dim a multiple of 64; a method that scores
from window sums; a layer the plan cuts). Anything else returns None, and the pass restores the layer as before.
"""

import ctypes

import torch

from . import native
from .compress import CompressionPlan
from .deferred import RestoringLayer
from .quantize import CHANNELS, TOKENS, Mixed, Quantized, _rotate
from .scoring import kept_indices

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
    if head_dim % 64 or head_dim > 256 or len({values.scheme.rotated for _, values in parts}) != 1:
        return False
    for keys, values in parts:
        key_scheme, value_scheme = keys.scheme, values.scheme
        if (key_scheme.axis != TOKENS or value_scheme.axis != CHANNELS or key_scheme.group % 16
                or value_scheme.group % 16 or head_dim % value_scheme.group or keys.shape[1] == 0
                or key_scheme.bits not in READABLE_BITS or value_scheme.bits not in READABLE_BITS
                or any(t.device.type != "cpu" for t in (keys.packed, values.packed))):
            return False
    return True


def _pointer_array(values: list[int], kind) -> ctypes.Array:
    return (kind * len(values))(*values)


def _column_of_positions(stored_keys) -> torch.Tensor | None:
    """Mixed.column_of_positions, or None for one part (its columns are the positions)."""
    return stored_keys.column_of_positions() if isinstance(stored_keys, Mixed) else None


@torch.inference_mode()
def attend_and_cut(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer,
                   plan: CompressionPlan) -> torch.Tensor | None:
    """The question's attention output (1, q, heads * head_dim), with `layer` (a deferred layer not yet restored)
    cut to the plan and holding only its kept positions (plan.kept updated as cut_layer does); None where this path
    does not apply (nothing is changed then). query (1, heads, q, head_dim), key and value (1, kv_heads, q, head_dim):
    the question's rows after RoPE (query, key), fp32."""
    if not isinstance(layer, RestoringLayer) or layer.restored or native.unavailable_reason() is not None:
        return None
    parts = _parts(layer.stored_keys, layer.stored_values)
    _, heads, rows, head_dim = query.shape
    kv_heads, stored = layer.stored_keys.shape[0], layer.stored_keys.shape[1]
    method = plan.cut.method
    window = min(plan.window, rows)
    if (parts is None or not _readable(parts, head_dim) or query.dtype != torch.float32 or query.shape[0] != 1
            or heads % kv_heads or not hasattr(method, "score_window_sums")
            or stored + rows <= plan.prefix_keep + window):
        return None
    group = heads // kv_heads
    values_rotated = parts[0][1].scheme.rotated
    grouped = query.contiguous().view(kv_heads, group * rows, head_dim)  # each KV head's query heads, one after another
    rotated = _rotate(grouped) if any(keys.scheme.rotated for keys, _ in parts) else grouped
    question_keys = key[0].contiguous()  # (kv_heads, q, head_dim)
    question_values = (_rotate(value[0]) if values_rotated else value[0]).contiguous()
    tail = torch.zeros(rows, rows).masked_fill_(torch.ones(rows, rows, dtype=torch.bool).triu(1), float("-inf"))
    columns = stored + rows
    weights = torch.empty(kv_heads, group * rows, columns)  # the kernel's room for scores and numerators
    output = torch.empty(kv_heads, group * rows, head_dim)
    sums = torch.empty(kv_heads, group, columns)
    tensors = [(keys.packed.contiguous(), keys.scale.contiguous(), keys.minimum.contiguous(), values.packed.contiguous(),
                values.scale.contiguous(), values.minimum.contiguous()) for keys, values in parts]
    pointers = _pointer_array([t.data_ptr() for part in tensors for t in part], ctypes.c_void_p)
    shapes = _pointer_array([number for keys, values in parts for number in (
        keys.shape[1], keys.scheme.bits, keys.scheme.group, int(keys.scheme.rotated), values.scheme.bits,
        values.scheme.group)], ctypes.c_int64)
    if native.kernels().attend_coded(
            grouped.data_ptr(), rotated.data_ptr(), kv_heads, group * rows, rows, module.scaling, head_dim, len(parts),
            pointers, shapes, question_keys.data_ptr(), question_values.data_ptr(), tail.data_ptr(),
            weights.data_ptr(), output.data_ptr(), window, sums.data_ptr(), torch.get_num_threads()) != 0:
        return None
    if values_rotated:  # back from the basis the values are stored in
        output = _rotate(output)
    column_of = _column_of_positions(layer.stored_keys)
    if column_of is not None:  # the stored columns back in position order
        sums[..., :stored] = sums[..., :stored].gather(-1, column_of.unsqueeze(1).expand(kv_heads, group, stored))
    scores = method.score_window_sums(sums.unsqueeze(0)[..., : columns - window])  # (1, kv_heads, columns - window)
    indices = kept_indices(scores, plan.prefix_keep, window)  # (1, kv_heads, kept), ascending
    layer.keys, layer.values = _restored_positions(layer, parts, indices[0], column_of, key[0], value[0])
    layer.restored = True
    plan.kept[module.layer_idx] = indices
    return output.view(heads, rows, head_dim).transpose(0, 1).reshape(1, rows, heads * head_dim)


def _restored_positions(layer, parts: list[tuple[Quantized, Quantized]], indices: torch.Tensor,
                        column_of: torch.Tensor | None, question_keys: torch.Tensor,
                        question_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's keys and values (1, kv_heads, kept, head_dim) at `indices` (kv_heads, kept) positions: the stored
    ones restored from their parts (row for row as the whole layer's restore gives them), the question's copied."""
    kv_heads, kept = indices.shape
    stored, head_dim = layer.stored_keys.shape[1], layer.stored_keys.shape[2]
    positions = indices.contiguous()
    restored = []
    for kind, question_rows in ((0, question_keys), (1, question_values)):
        chosen = [part[kind] for part in parts]
        tensors = [t.contiguous() for part in chosen for t in (part.packed, part.scale, part.minimum)]
        shapes = [number for part in chosen for number in (
            part.shape[1], part.scheme.bits, int(part.scheme.axis == TOKENS), part.scheme.group,
            (head_dim & -head_dim) if part.scheme.rotated else 0)]
        rows = question_rows.contiguous()
        out = torch.empty(1, kv_heads, kept, head_dim)
        if native.kernels().dequantize_positions(
                _pointer_array([t.data_ptr() for t in tensors], ctypes.c_void_p), _pointer_array(shapes, ctypes.c_int64),
                len(chosen), None if column_of is None else column_of.data_ptr(), kv_heads, stored, head_dim,
                positions.data_ptr(), kept, rows.data_ptr(), rows.shape[1], out.data_ptr(),
                torch.get_num_threads()) != 0:
            raise RuntimeError("snapkv's kernels refused a saved layer's kept rows")  # never expected: all checked
        restored.append(out)
    return restored[0], restored[1]
