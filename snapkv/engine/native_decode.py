"""One decoded token through every layer in one C call (snapkv/native/kernels/decode_step.c), for a plain Llama-family
model on CPU whose projections are 4/8-bit blocks (snapkv.modeling.block_weights: the embedded model in fp32) or plain
bf16/fp32 rows fused at load (snapkv.modeling.dense_weights: a user's checkpoint, in bf16 or in fp32).

snapkv.engine.lean_decode already writes one token's forward as the few PyTorch calls it needs, but on a 2-core CPU
those ~35 calls per layer, and sdpa's attention for one query row (a kernel made for many rows), still cost
more than reading the weights. Here the layers run without Python between them: norms, RoPE, the cache write,
the attention and the SiLU in C, the products by the block or plain-row kernels, all in fp32; then the final norm and
the head in one more call (final_logits: PyTorch's norm and the head's module around the same kernel took 0.3-0.5
ms of a SnapKV token's 7-8 on a 2-core AVX-512 CPU). The same formulas, summed in another order: logits agree with the
lean step within rounding (tests/test_native_decode.py, tests/test_dense_weights.py against an fp32 twin of a bf16
model), greedy answers token for token in the tests and on the needle grid.

QuestionLayers does the same for a question's rows around each layer's attention (the attention, the cache write and
the cut stay snapkv.engine.native_question's): ~17 ms of a ~0.25 s follow-up at 8k tokens, interleaved runs.

Used by snapkv.engine.generation.answer where `for_cache` finds everything it needs (the lean step's conditions, fused
q/k/v and gate/up matrices, q/k/v biases and Qwen3's q/k norms applied in C, the kernels available); else the lean
step, as before. The C call reads the cache's rows where the question's pass left them (fp32 or bf16, bf16 widened
exactly: no copy of the cache), and writes each token's keys and values into the answer's own fp32 buffers, sized
for it; `sync` hands the whole over as plain layers in the model's dtype (before the lean step takes over from it).
"""
import ctypes
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from snapkv import native
from snapkv.engine import lean_decode
from snapkv.engine.working_cache import WorkingCache
from snapkv.modeling.block_weights import BlockLinear, Blocks, fused_blocks
from snapkv.modeling.dense_weights import DENSE_DTYPES, fused_dense, plain_weight
from snapkv.modeling.gguf_weights import GGUFEmbedding, GGUFLinear
from snapkv.modeling.presized import PresizedLayer
from snapkv.native.threads import threads_now

ROOM_EXHAUSTED = -2  # decode_token's status when a layer's buffer is full (nothing written)


def _matrix(blocks: Blocks) -> native.BlockMatrix:
    """The C view of `blocks`, its shape as its scales give it (decode_token checks it against the model's)."""
    outputs, block_count = blocks.scale.shape
    return native.BlockMatrix(blocks.bits, *blocks.pointers(), outputs, block_count * 32)


def _contiguous(blocks: Blocks) -> bool:
    return all(part is None or part.is_contiguous() for part in (blocks.codes, blocks.scale, blocks.minimum))


def _plain_blocks(linear: torch.nn.Module) -> Blocks | None:
    return linear.blocks if isinstance(linear, BlockLinear) and linear.bias is None else None


HELD_BITS = {torch.float32: 32, torch.bfloat16: 16}  # the cache dtypes decode_token reads where they are


@dataclass
class ModelLayers:
    """The C view of a model's decoder layers (norms and projections; no cache buffers yet) and its shape. `kept`
    holds the tensors the pointers read that the model itself does not (fp32 copies of bf16 norms)."""

    shape: native.DecoderShape
    layers: list[native.DecoderLayer]
    kept: list[torch.Tensor]


class NativeDecoder:
    """decode_token over one answer: the cache's rows read where the question's pass left them, the answer's own in
    fp32 buffers with room for it; build with for_cache."""

    def __init__(self, model, cache: WorkingCache, found: ModelLayers, held: list[tuple[torch.Tensor, torch.Tensor]],
                 steps: int, cos: torch.Tensor, sin: torch.Tensor, first_position: int) -> None:
        """held: per layer, the cache's keys and values (kv_heads, tokens, head_dim), contiguous fp32 or bf16."""
        self._model, self._cache = model, cache
        kv_heads, head_dim = found.shape.kv_heads, found.shape.head_dim
        # per layer, the answer's keys and values (kv_heads, steps, head_dim) fp32, written by the C calls
        self._answer = [(torch.empty(kv_heads, steps, head_dim), torch.empty(kv_heads, steps, head_dim))
                        for _ in held]
        for layer, (keys, values), (answer_keys, answer_values) in zip(found.layers, held, self._answer):
            layer.held_keys, layer.held_values = (native.pointer(part, part.dtype) for part in (keys, values))
            layer.held, layer.held_bits = keys.shape[1], HELD_BITS[keys.dtype]
            layer.keys, layer.values = (native.pointer(part, torch.float32) for part in (answer_keys, answer_values))
            layer.capacity, layer.filled = steps, 0
        self._layers = (native.DecoderLayer * len(found.layers))(*found.layers)
        self._shape = found.shape
        self._cos, self._sin = cos, sin  # (positions, head_dim) from first_position on
        self._first_position = first_position
        self._hidden = torch.empty(found.shape.hidden)
        self._head = output_head(model)
        # the tensors the C side reads and writes, kept alive as long as the pointers are
        self._held, self._kept = held, found.kept
        # Each token's Python is only address arithmetic, the C calls and the logits' allocation: run right after a
        # call that streamed the weights through the caches, every PyTorch op costs several times what it costs alone
        # (0.28 ms a token here before, against 7 for the C calls)
        self._decode_token = native.kernels().decode_token
        self._shape_address = ctypes.addressof(self._shape)
        self._hidden_address = native.pointer(self._hidden, torch.float32, (found.shape.hidden,))
        self._angle_bytes = head_dim * 4  # a row of cos or sin
        self._cos_address, self._sin_address = (native.pointer(angles, torch.float32, (None, head_dim))
                                                for angles in (cos, sin))
        table = model.model.embed_tokens
        embeddings = table.weight
        fp32_rows = (not isinstance(table, GGUFEmbedding) and embeddings.dtype == torch.float32
                     and embeddings.is_contiguous() and embeddings.device.type == "cpu")
        self._embedding_address = (native.pointer(embeddings, torch.float32, (None, found.shape.hidden)) if fp32_rows
                                   else None)  # else looked up by the module (bf16 widened, a GGUF's blocks)
        self._vocab, self._row_bytes = embeddings.shape[0], found.shape.hidden * 4

    def step(self, token: int, position: int) -> torch.Tensor | None:
        """Append `token` at `position`; the next logits (vocab,), or None when a layer's room is full (nothing
        written: call sync, then the lean step grows the buffers)."""
        index = position - self._first_position
        if 0 <= index < self._cos.shape[0]:
            cos, sin = (address + index * self._angle_bytes for address in (self._cos_address, self._sin_address))
        else:
            with torch.inference_mode():
                angles = _rotary(self._model, position, 1)  # (1, head_dim) each, alive until the call returns
            cos, sin = (native.pointer(part, torch.float32) for part in angles)
        if self._embedding_address is not None and 0 <= token < self._vocab:
            ctypes.memmove(self._hidden_address, self._embedding_address + token * self._row_bytes, self._row_bytes)
        else:
            with torch.inference_mode():
                self._hidden.copy_(self._model.model.embed_tokens(torch.tensor([token]))[0])
        status = self._decode_token(self._shape_address, self._layers, len(self._layers), self._hidden_address, cos,
                                    sin, threads_now())
        if status == ROOM_EXHAUSTED:
            return None
        if status != 0:  # out of memory (matrices of another shape too: never expected, for_cache read them)
            raise MemoryError("the C decode step ran out of memory (or refused the model's weight blocks)")
        logits = self._head.logits_at(self._hidden_address, self._shape.hidden) if self._head is not None else None
        return logits if logits is not None else output_logits(self._model, self._hidden.view(1, 1, -1), None)

    def written(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values (1, kv_heads, tokens, head_dim) as this answer holds them: the cache's rows
        then the answer's, in fp32 (a copy)."""
        filled = self._layers[index].filled
        keys, values = self._held[index]
        answer_keys, answer_values = self._answer[index]
        return (torch.cat([keys.float(), answer_keys[:, :filled]], dim=1).unsqueeze(0),
                torch.cat([values.float(), answer_values[:, :filled]], dim=1).unsqueeze(0))

    def sync(self) -> None:
        """Hand the working cache over to the steps that take over from these: every layer a plain one in the model's
        dtype holding the cache's rows and the answer's written so far."""
        dtype = self._model.model.embed_tokens.weight.dtype
        for index in range(len(self._cache.layers)):
            keys, values = self.written(index)
            self._cache.hold(index, keys.to(dtype), values.to(dtype))


@dataclass
class OutputHead:
    """The final norm and lm_head as kernels/decode_step.c's final_logits reads them: one C call from the last
    layer's output to the logits."""

    norm: torch.Tensor  # (hidden,) fp32: the final norm's weight (a copy if bf16)
    eps: float
    matrix: native.BlockMatrix  # lm_head: 4/8-bit blocks, or plain bf16/fp32 rows (vocab, hidden)
    weights: object  # what the matrix's pointers read: kept alive with it

    def __post_init__(self) -> None:
        self._norm_address = native.pointer(self.norm, torch.float32)
        self._final_logits = native.kernels().final_logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden (hidden,) fp32 contiguous -> the logits (vocab,); None where the kernel refused."""
        return self.logits_at(native.pointer(hidden, torch.float32, (self.norm.shape[0],)), hidden.shape[0])

    def logits_at(self, hidden: int, size: int) -> torch.Tensor | None:
        """logits() of the `size` fp32 values at address `hidden`."""
        logits = torch.empty(self.matrix.outputs)  # (vocab,)
        status = self._final_logits(hidden, size, self._norm_address, self.eps, ctypes.byref(self.matrix),
                                    native.pointer(logits, torch.float32), threads_now())
        return logits if status == 0 else None


def output_head(model) -> OutputHead | None:
    """The model's final norm and lm_head for final_logits, or None where the kernels cannot read them (no kernels,
    an lm_head neither 4/8-bit blocks nor plain bf16/fp32 rows, a norm in another dtype)."""
    norm, head = model.model.norm, model.lm_head
    if (native.unavailable_reason() is not None or norm.weight.dtype not in DENSE_DTYPES
            or not hasattr(norm, "variance_epsilon")):
        return None
    blocks, weight = _plain_blocks(head), plain_weight(head)
    matrix = _c_matrix(blocks, weight) if not isinstance(head, GGUFLinear) else _gguf_part(head, with_bias=False)
    if matrix is None:
        return None
    read = head if isinstance(head, GGUFLinear) else blocks if blocks is not None else weight
    return OutputHead(norm.weight.detach().float().contiguous(), norm.variance_epsilon, matrix, read)


def output_logits(model, hidden: torch.Tensor, head: OutputHead | None) -> torch.Tensor:
    """hidden (1, rows, hidden) fp32, the last layer's output -> the last row's logits (vocab,): the final norm, then
    lm_head, in one C call where there is a `head` (output_head(model)): a bf16 or fp32 lm_head by the kernels of
    dense_rows.c (PyTorch's fp32 product for one row of the embedded model's 49152 x 576 head took 11.3 ms, this 4.4);
    else by the modules themselves."""
    if head is not None:
        logits = head.logits(hidden[0, -1].float().contiguous())
        if logits is not None:
            return logits
    normed = lean_decode.rms_norm(model.model.norm, hidden[:, -1:])
    return model.lm_head(normed.to(model.get_input_embeddings().weight.dtype))[0, -1]


def _rotary(model, first_position: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (count, head_dim) contiguous fp32, for positions first_position.. from the model's own
    rotary module (so its scaling, e.g. Llama 3's, is the model's)."""
    inner = model.model
    positions = torch.arange(first_position, first_position + count).unsqueeze(0)  # (1, count)
    probe = torch.zeros(1, 1, 1)  # fp32 on the CPU: the angles' dtype, as the C step computes them
    cos, sin = inner.rotary_emb(probe, positions)  # (1, count, head_dim) each
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def _c_matrix(blocks: Blocks | None, weight: torch.Tensor | None) -> native.BlockMatrix | None:
    """The C view of a projection given as its 4/8-bit blocks, or else as its plain bf16/fp32 rows
    (snapkv.modeling.dense_weights); None where it is neither (or its blocks are not contiguous)."""
    if blocks is not None:
        return _matrix(blocks) if _contiguous(blocks) else None
    return _dense_matrix(weight) if weight is not None else None


def _gguf_part(linear: torch.nn.Module, with_bias: bool) -> native.BlockMatrix | None:
    """The C view of a projection read in a GGUF file's own blocks (snapkv.modeling.gguf_weights), or None where it is
    not one (or has a bias and with_bias is False: its bias is added apart, by the layer)."""
    if not isinstance(linear, GGUFLinear) or (linear.bias is not None and not with_bias):
        return None
    matrix = linear.matrix
    dense = matrix.dense()
    if dense is not None:
        return _dense_matrix(dense)
    return native.BlockMatrix(0, native.pointer(matrix.blocks, torch.uint8, (matrix.outputs, None)), None, None,
                              matrix.outputs, matrix.inputs, matrix.type_id, matrix.blocks.shape[1], None)


def _gguf_stack(linears: list[torch.nn.Module], kept: list) -> native.BlockMatrix | None:
    """Projections in a GGUF file's own blocks (q, k, v; gate, up) as one matrix whose parts follow one another
    (block_matrix.next: each part in its own type), the first returned, the others kept alive in `kept`; None where
    any is not such a projection."""
    parts = [_gguf_part(linear, with_bias=True) for linear in linears]
    if any(part is None for part in parts):
        return None
    for part, following in zip(parts, parts[1:]):
        part.next = ctypes.addressof(following)
    kept.extend(parts)
    return parts[0]


def _qkv_bias(attention: torch.nn.Module, kept: list) -> int | None:
    """The address of q, k and v's biases one after another (fp32; zeros for a projection without one), None where
    none has a bias."""
    linears = [attention.q_proj, attention.k_proj, attention.v_proj]
    if all(linear.bias is None for linear in linears):
        return None
    bias = torch.cat([linear.bias.detach().float() if linear.bias is not None else torch.zeros(linear.out_features)
                      for linear in linears]).contiguous()  # (q + k + v outputs,)
    kept.append(bias)
    return native.pointer(bias, torch.float32)


def _head_norms(attention: torch.nn.Module) -> tuple | None:
    """An attention's RMSNorms of each q and k head (Qwen3) as (q_norm, k_norm), () where it has neither, None where
    it has only one or they are norms of another kind (Gemma 3's, which scale by 1 + weight)."""
    found = tuple(getattr(attention, name, None) for name in ("q_norm", "k_norm"))
    if found == (None, None):
        return ()
    return found if all(type(norm).__name__ == "Qwen3RMSNorm" for norm in found) else None


def _dense_matrix(weight: torch.Tensor) -> native.BlockMatrix:
    outputs, inputs = weight.shape
    return native.BlockMatrix(DENSE_DTYPES[weight.dtype], native.pointer(weight, weight.dtype), None, None, outputs,
                              inputs)


def _model_layers(model) -> ModelLayers | None:
    """The C view of every decoder layer, or None where the layers are not ones the C code takes (embeddings neither
    fp32 nor bf16, projections neither fused 4/8-bit blocks nor fused plain bf16/fp32 rows, biases, norms of other
    epsilons, a head size not a multiple of 8). The callers check the rest (lean_decode.qualifies: a plain
    Llama-family model on CPU)."""
    if native.unavailable_reason() is not None:
        return None
    config, inner = model.config, model.model
    decoder_layers = inner.layers
    if inner.embed_tokens.weight.dtype not in DENSE_DTYPES:
        return None
    attention = decoder_layers[0].self_attn
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim, hidden, intermediate = attention.head_dim, config.hidden_size, config.intermediate_size
    if head_dim % 8 or heads % kv_heads:
        return None
    layers, kept = [], []
    for decoder_layer in decoder_layers:
        attention, mlp = decoder_layer.self_attn, decoder_layer.mlp
        if isinstance(attention.q_proj, GGUFLinear):  # a GGUF file's blocks: parts in their own types, q/k/v biases
            qkv = _gguf_stack([getattr(attention, name) for name in lean_decode.QKV], kept)
            gate_up = _gguf_stack([getattr(mlp, name) for name in lean_decode.GATE_UP], kept)
            o, down = (_gguf_part(linear, with_bias=False) for linear in (attention.o_proj, mlp.down_proj))
            bias = _qkv_bias(attention, kept)
        else:
            qkv, gate_up = (_c_matrix(fused_blocks(parent, names), fused_dense(parent, names))
                            for parent, names in ((attention, lean_decode.QKV), (mlp, lean_decode.GATE_UP)))
            o, down = (_c_matrix(_plain_blocks(linear), plain_weight(linear))
                       for linear in (attention.o_proj, mlp.down_proj))
            bias = _qkv_bias(attention, kept) if qkv is not None else None
        matrices = (qkv, o, gate_up, down)
        norms = (decoder_layer.input_layernorm, decoder_layer.post_attention_layernorm)
        head_norms = _head_norms(attention)  # Qwen3's norms of each q and k head; () where there are none
        biased_mlp = any(getattr(mlp, name).bias is not None for name in lean_decode.GATE_UP)  # not in the C step
        if head_norms is None or biased_mlp or None in matrices or any(
                norm.weight.dtype not in DENSE_DTYPES
                or getattr(norm, "variance_epsilon", None) != decoder_layers[0].input_layernorm.variance_epsilon
                for norm in (*norms, *head_norms)):
            return None
        norm_weights = [norm.weight.detach().float().contiguous() for norm in norms]  # (hidden,) each: a copy if bf16
        head_weights = [norm.weight.detach().float().contiguous() for norm in head_norms]  # (head_dim,) each
        kept += norm_weights + head_weights
        q_norm, k_norm = ([native.pointer(weight, torch.float32, (head_dim,)) for weight in head_weights]
                          or [None, None])
        layers.append(native.DecoderLayer(*(native.pointer(weight, torch.float32, (hidden,)) for weight in norm_weights),
                                          *matrices, qkv_bias=bias, q_norm=q_norm, k_norm=k_norm))
    shape = native.DecoderShape(hidden, heads, kv_heads, head_dim, intermediate,
                                decoder_layers[0].input_layernorm.variance_epsilon, attention.scaling)
    return ModelLayers(shape, layers, kept)


def _held_rows(layer, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A cache layer's keys and values (kv_heads, tokens, head_dim), contiguous (a copy only where they were not), for
    decode_token to read where they are; None for a layer it does not take (not a plain or presized full-attention
    layer of one batch entry in fp32 or bf16)."""
    if type(layer) not in (DynamicLayer, PresizedLayer) or not layer.is_initialized:
        return None
    keys, values = layer.keys, layer.values
    if keys.shape[0] != 1 or tuple(keys.shape[1::2]) != (kv_heads, head_dim) or keys.dtype not in HELD_BITS:
        return None
    if values.shape != keys.shape or values.dtype != keys.dtype:
        return None
    return keys[0].contiguous(), values[0].contiguous()


@torch.inference_mode()
def for_cache(model, cache: WorkingCache, first_position: int, steps: int) -> NativeDecoder | None:
    """A NativeDecoder for `steps` tokens from `first_position` over `cache`, which it reads where it is (the cache
    itself is left as it is until sync), or None where the model or the cache is not one it takes: then the lean step
    decodes."""
    if native.unavailable_reason() is not None or not lean_decode.qualifies(model, cache) or steps < 1:
        return None
    if len(model.model.layers) != len(cache.layers):
        return None
    found = _model_layers(model)
    if found is None:
        return None
    kv_heads, head_dim = model.config.num_key_value_heads, found.shape.head_dim
    if head_dim > native.limit("snapkv_max_decode_head_dim"):
        return None
    held = [_held_rows(layer, kv_heads, head_dim) for layer in cache.layers]
    if any(rows is None for rows in held):
        return None
    cos, sin = _rotary(model, first_position, steps)
    return NativeDecoder(model, cache, found, held, steps, cos, sin, first_position)


class QuestionLayers:
    """A question's rows through each layer's parts before and after its attention in C
    (snapkv/native/kernels/decode_step.c's question_before_attention / question_after_attention: norms, the fused
    products, RoPE and the SiLU as decode_token computes them), for snapkv.engine.native_question; build with
    question_layers. The attention, the cache write and the cut stay the pass's own."""

    def __init__(self, found: ModelLayers) -> None:
        self._shape = found.shape
        self._layers = found.layers
        self._kept = found.kept  # what the pointers read that the model does not hold

    def before(self, index: int, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden (1, q, hidden) fp32 contiguous; cos, sin (1, q, head_dim) -> normed (1, q, hidden), query
        (1, heads, q, head_dim) with RoPE, key (1, kv_heads, q, head_dim) with RoPE, value (1, kv_heads, q,
        head_dim)."""
        shape, rows = self._shape, hidden.shape[1]
        normed = torch.empty(1, rows, shape.hidden)
        query = torch.empty(1, shape.heads, rows, shape.head_dim)
        key, value = (torch.empty(1, shape.kv_heads, rows, shape.head_dim) for _ in range(2))
        cos, sin = cos.contiguous(), sin.contiguous()
        fp32, angles = torch.float32, (1, rows, shape.head_dim)
        if native.kernels().question_before_attention(
                ctypes.byref(shape), ctypes.byref(self._layers[index]), rows,
                native.pointer(hidden, fp32, (1, rows, shape.hidden)), native.pointer(cos, fp32, angles),
                native.pointer(sin, fp32, angles), *(native.pointer(out, fp32) for out in (normed, query, key, value)),
                threads_now()) != 0:
            raise MemoryError("the C question layer ran out of memory (or refused the model's weight blocks)")
        return normed, query, key, value

    def after(self, index: int, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (1, q, hidden) in place: plus the attention's projection, then plus the MLP's output; attended
        (1, q, heads * head_dim). Returns hidden."""
        attended, shape, rows = attended.contiguous(), self._shape, hidden.shape[1]
        if native.kernels().question_after_attention(
                ctypes.byref(shape), ctypes.byref(self._layers[index]), rows,
                native.pointer(attended, torch.float32, (1, rows, shape.heads * shape.head_dim)),
                native.pointer(hidden, torch.float32, (1, rows, shape.hidden)), threads_now()) != 0:
            raise MemoryError("the C question layer ran out of memory (or refused the model's weight blocks)")
        return hidden


def question_layers(model) -> QuestionLayers | None:
    """QuestionLayers for `model`, or None where its layers are not ones the C parts take (lean_decode's
    question pass then computes them with PyTorch's ops: snapkv.engine.torch_question.LayerParts)."""
    found = _model_layers(model)
    return QuestionLayers(found) if found is not None else None
