"""GGUF material for tests, made here: random blocks of each type ggml defines, and tiny models written as llama.cpp
writes them (gguf-py's writer; Q and K rows of `llama` files permuted as llama.cpp's converter permutes them), with
the embedded model's tokenizer so that transformers can read their config and tokenizer."""

import struct
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

from snapkv.modeling.gguf_file import GGUFFile
from snapkv.modeling.gguf_weights import SCALE_FIELDS

HALF_FIELDS = SCALE_FIELDS  # where each type keeps its fp16 scales: set to small finite values in random blocks
BLOCK_TYPES = tuple(HALF_FIELDS)
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32")  # gguf-py's writer quantizes these


def random_blocks(type_name: str, rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """(rows, row bytes) uint8: rows of k weights in random blocks of `type_name` (every code and 6-bit scale a random
    bit pattern; the fp16 fields random finite values of either sign, as files hold)."""
    elements, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    count = k // elements
    raw = torch.randint(0, 256, (rows, count, size), dtype=torch.uint8, generator=generator)
    for offset in HALF_FIELDS[type_name]:
        halves = (torch.rand(rows, count, generator=generator) * 0.02 + 0.001) * torch.randint(
            0, 2, (rows, count), generator=generator).mul(2).sub(1)
        raw[:, :, offset:offset + 2] = halves.half().view(torch.uint8).view(rows, count, 2)
    return raw.reshape(rows, count * size)


def gguf_py_weights(type_name: str, blocks: torch.Tensor) -> torch.Tensor:
    """gguf-py's own dequantization of rows of blocks: (rows, k) fp32."""
    return torch.from_numpy(np.ascontiguousarray(
        quants.dequantize(blocks.numpy(), GGMLQuantizationType[type_name]))).float()


def llama_cpp_order(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a Q or K weight (heads * head_dim, in) in the order llama.cpp's converter writes them for `llama`
    files (each head's two rotary halves interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _blocks_for(weight: torch.Tensor, type_name: str, generator: torch.Generator) -> tuple[np.ndarray, torch.Tensor]:
    """(the file's bytes or values for `weight`, the fp32 weights they stand for): quantized by gguf-py where it can,
    random blocks for the K-quants (which gguf-py cannot make)."""
    if type_name in ("F32",):
        return weight.numpy().astype(np.float32), weight.clone()
    if type_name in QUANTIZABLE:
        raw = quants.quantize(weight.numpy().astype(np.float32), GGMLQuantizationType[type_name])
        stands_for = quants.dequantize(raw, GGMLQuantizationType[type_name])
        return raw, torch.from_numpy(np.ascontiguousarray(stands_for)).float().reshape(weight.shape)
    blocks = random_blocks(type_name, weight.shape[0], weight.shape[1], generator)
    return blocks.numpy(), gguf_py_weights(type_name, blocks)


LINEAR_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down"}


def write_tiny_gguf(path: Path, model: torch.nn.Module, architecture: str, types: dict[str, str],
                    tokenizer_from: Path, seed: int = 0) -> torch.nn.Module:
    """Write `model` (a tiny transformers model, its vocabulary the size of tokenizer_from's) to `path` as a GGUF of
    `architecture` ("llama", "qwen2" or "qwen3"), each projection in types[its llama.cpp name] (default Q8_0), the embeddings
    in types["token_embd"], norms and biases F32, and the tokenizer, chat template and special tokens copied from the
    GGUF file tokenizer_from. The model's weights are replaced by the values the file stands for (the reference the
    file's model must match) and the model is returned."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    source = GGUFFile(tokenizer_from)
    writer = GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    meta = source.metadata
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(list(meta["tokenizer.ggml.tokens"]))
    writer.add_token_types(list(meta["tokenizer.ggml.token_type"]))
    writer.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    for key, add in (("tokenizer.ggml.bos_token_id", writer.add_bos_token_id),
                     ("tokenizer.ggml.eos_token_id", writer.add_eos_token_id),
                     ("tokenizer.ggml.padding_token_id", writer.add_pad_token_id)):
        if key in meta:
            add(meta[key])
    writer.add_chat_template(meta["tokenizer.chat_template"])
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def matrix(name: str, weight: torch.Tensor, type_name: str, rows_for: int | None = None) -> torch.Tensor:
        written = llama_cpp_order(weight, rows_for) if rows_for else weight
        raw, stands_for = _blocks_for(written.detach().float(), type_name, generator)
        writer.add_tensor(name, raw, raw_shape=None if type_name == "F32" else raw.shape,
                          raw_dtype=GGMLQuantizationType[type_name])
        if rows_for:  # back in transformers' order
            half = weight.shape[0] // rows_for // 2
            stands_for = stands_for.reshape(rows_for, half, 2, -1).swapaxes(1, 2).reshape(weight.shape)
        return stands_for

    def values(name: str, tensor: torch.Tensor) -> None:
        writer.add_tensor(name, tensor.detach().float().numpy().astype(np.float32))

    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings.copy_(matrix("token_embd.weight", embeddings, types.get("token_embd", "Q8_0")))
        if not config.tie_word_embeddings:
            head = model.get_output_embeddings().weight
            head.copy_(matrix("output.weight", head, types.get("output", "Q8_0")))
        values("output_norm.weight", model.model.norm.weight)
        for index, layer in enumerate(model.model.layers):
            values(f"blk.{index}.attn_norm.weight", layer.input_layernorm.weight)
            values(f"blk.{index}.ffn_norm.weight", layer.post_attention_layernorm.weight)
            if getattr(layer.self_attn, "q_norm", None) is not None:  # Qwen3: each q and k head RMS-normed
                values(f"blk.{index}.attn_q_norm.weight", layer.self_attn.q_norm.weight)
                values(f"blk.{index}.attn_k_norm.weight", layer.self_attn.k_norm.weight)
            for module_path, short in LINEAR_NAMES.items():
                linear = layer.get_submodule(module_path)
                permuted = {"attn_q": heads, "attn_k": kv_heads}.get(short) if architecture == "llama" else None
                linear.weight.copy_(matrix(f"blk.{index}.{short}.weight", linear.weight, types.get(short, "Q8_0"),
                                           permuted))
                if linear.bias is not None:
                    values(f"blk.{index}.{short}.bias", linear.bias)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_bytes(tensors: list[tuple[str, tuple[int, ...], int, int]], data: bytes, *, version: int = 3,
               metadata: bytes | None = None, metadata_count: int | None = None, tensor_count: int | None = None,
               magic: bytes = b"GGUF", alignment: int = 32) -> bytes:
    """A GGUF file put together by hand, so that any field can be wrong: tensors as (name, dimensions innermost first,
    type id, offset), `data` after the padding; metadata one string entry unless given (raw entries and their
    count)."""
    if metadata is None:
        metadata, metadata_count = _string("general.architecture") + struct.pack("<I", 8) + _string("llama"), 1
    header = magic + struct.pack("<IQQ", version, len(tensors) if tensor_count is None else tensor_count,
                                 metadata_count)
    infos = b"".join(_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                     + struct.pack("<IQ", type_id, offset) for name, dims, type_id, offset in tensors)
    body = header + metadata + infos
    return body + b"\0" * (-len(body) % alignment) + data
