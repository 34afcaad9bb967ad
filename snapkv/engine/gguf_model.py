"""A GGUF file as a transformers model whose weights stay in the file's own blocks (snapkv.modeling.gguf_weights): the
config and tokenizer converted once into a small folder in the snapkv home, the model built without weights
(PyTorch's meta device), then each projection and the embeddings made a view of the mapped file, the norms and biases
(small F32 tensors) copied. Memory is about the file's size; nothing is written but the config and tokenizer.

Read as llama.cpp writes them: the architectures below, their tensors by llama.cpp's names, and for `llama` files
(Llama, Mistral) the rows of Q and K in the order llama.cpp's converter permuted them to, taken back (a gathered copy
of those two matrices' blocks, as transformers' own GGUF loader undoes it over the dequantized weights).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from snapkv.base.errors import ModelFileError, UnsupportedModelError
from snapkv.engine.conversion import gguf_folder, made_once
from snapkv.modeling.gguf_file import COMPUTED_TYPES, GGUFFile
from snapkv.modeling.gguf_weights import GGUFEmbedding, GGUFLinear, GGUFMatrix, random_matrix

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # general.architecture values read; Mistral files say llama
PERMUTED_QK = ("llama",)  # llama.cpp's converter interleaved the rotary halves of Q and K rows for these

# llama.cpp's tensor names -> transformers' module paths ("{i}": the layer)
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj", "attn_k.weight": "self_attn.k_proj", "attn_v.weight": "self_attn.v_proj",
    "attn_output.weight": "self_attn.o_proj",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj", "ffn_up.weight": "mlp.up_proj", "ffn_down.weight": "mlp.down_proj",
}
# norms and biases first, then the projections, which take the biases already set on their places
VALUES_FIRST = sorted(LAYER_TENSORS.items(), key=lambda item: not item[1].endswith((".weight", ".bias")))


@dataclass
class GGUFModel:
    """What load_gguf gives: the model, its tokenizer, the folder its config and tokenizer were converted into, and
    the mapped file (kept open as long as the model reads it)."""

    model: torch.nn.Module
    tokenizer: object
    folder: Path
    file: GGUFFile

    @property
    def block_bytes(self) -> int:
        """The blocks the model reads, each once (a tied head reads the embeddings' own)."""
        matrices = {id(module.matrix): module.matrix.nbytes for module in self.model.modules()
                    if isinstance(module, (GGUFLinear, GGUFEmbedding))}  # a tied head holds the same matrix object
        return sum(matrices.values())

    def describe(self) -> str:
        """The weights in words, for reports: "196 linear layers in the file's own blocks (Q4_K, Q6_K), 1.0 GiB"."""
        linears = [module for module in self.model.modules() if isinstance(module, GGUFLinear)]
        kinds = sorted({module.matrix.type_name for module in linears})
        return (f"{len(linears)} linear layers in the GGUF file's own blocks ({', '.join(kinds)}), "
                f"{self.block_bytes / 2**30:.2f} GiB mapped")


CONFIG_STEPS = 2  # reported while the config and tokenizer are converted: the tokenizer, then saved


def with_file_head_dim(config, metadata: dict):
    """`config` with the head size the file states (`<architecture>.attention.key_length`), where it gives one:
    transformers reads none for some architectures (Qwen3: its default 128 whatever the file's)."""
    head_dim = metadata.get(f"{metadata.get('general.architecture')}.attention.key_length")
    if isinstance(head_dim, int) and getattr(config, "head_dim", None) != head_dim:
        config.head_dim = head_dim
    return config


def config_and_tokenizer(gguf: Path, on_progress: Callable[[int, int], None] | None = None) -> Path:
    """The folder holding this GGUF's config.json and tokenizer files, converted the first time (a few seconds: the
    tokenizer's vocabulary; snapkv.engine.conversion.made_once)."""
    report = on_progress or (lambda done, total: None)

    def make(staging: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        report(0, CONFIG_STEPS)
        config = with_file_head_dim(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                               local_files_only=True), GGUFFile(gguf).metadata)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        report(1, CONFIG_STEPS)
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        report(CONFIG_STEPS, CONFIG_STEPS)

    return made_once(gguf_folder(gguf, "-config"), make, f"read the config and tokenizer of {gguf}")


def _matrix(file: GGUFFile, name: str, shape: tuple[int, int]) -> GGUFMatrix:
    """The tensor `name` as a GGUFMatrix of (outputs, inputs) `shape`, refused where the file disagrees."""
    info = file.tensors.get(name)
    if info is None:
        raise ModelFileError(f"{file.path}: tensor {name} is missing")
    if info.shape != tuple(shape):
        raise ModelFileError(f"{file.path}: tensor {name} is {list(info.shape)} where the model's config needs "
                             f"{list(shape)}")
    if info.type_name not in COMPUTED_TYPES:
        raise ModelFileError(f"{file.path}: tensor {name} is {info.type_name}, a type snapkv does not compute with "
                             f"(it reads {', '.join(sorted(COMPUTED_TYPES))}: Q4_K_M, Q5_K_M, Q6_K, Q8_0 files)")
    return GGUFMatrix(info.type_id, info.type_name, file.tensor_bytes(name), *shape)


def _rotary_order(rows: int, heads: int) -> torch.Tensor:
    """The rows of a llama.cpp Q or K matrix to take, in order, to give transformers' rows: per head, llama.cpp
    interleaved the two rotary halves (row 2 i is transformers' i, row 2 i + 1 its i + half)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)  # (rows,)


def _set(model: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, module)


def _set_values(model: torch.nn.Module, path: str, values: torch.Tensor) -> None:
    """A parameter (a norm's weight, a bias) given its values; its shape must be the config's."""
    parent_path, _, name = path.rpartition(".")
    current = getattr(model.get_submodule(parent_path), name)  # None where the config gives no bias
    if current is None or tuple(current.shape) != tuple(values.shape):
        expected = None if current is None else list(current.shape)
        raise ModelFileError(f"{path}: the file gives {list(values.shape)} values where the model's config needs "
                             f"{expected}")
    _set(model, path, torch.nn.Parameter(values, requires_grad=False))


def load_gguf(path: Path, attn_implementation: str, on_progress: Callable[[int, int], None] | None = None) -> GGUFModel:
    """The model in the GGUF file at `path`, its weights read where the file is mapped. Raises ModelFileError for a
    file that is damaged or disagrees with its own config, UnsupportedModelError for an architecture not read."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    file = GGUFFile(path)
    architecture = file.metadata.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {architecture!r} is not one snapkv reads in its own "
                                    f"blocks (it reads {', '.join(ARCHITECTURES)})")
    folder = config_and_tokenizer(path, on_progress)
    # the file's head size again: a folder converted by an older snapkv may hold transformers' default
    config = with_file_head_dim(AutoConfig.from_pretrained(folder, local_files_only=True), file.metadata)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for index in range(config.num_hidden_layers):
        layer = f"model.layers.{index}"
        for gguf_name, module_path in VALUES_FIRST:
            name, target = f"blk.{index}.{gguf_name}", f"{layer}.{module_path}"
            if name not in file.tensors:
                continue
            if module_path.endswith((".weight", ".bias")):
                _set_values(model, target, file.tensor_values(name))
                continue
            linear = model.get_submodule(target)
            matrix = _matrix(file, name, (linear.out_features, linear.in_features))
            if architecture in PERMUTED_QK and gguf_name in ("attn_q.weight", "attn_k.weight"):
                matrix = matrix.rows(_rotary_order(matrix.outputs, heads if gguf_name == "attn_q.weight" else kv_heads))
            bias = linear.bias
            if bias is not None and bias.is_meta:
                raise ModelFileError(f"{path}: the config gives {target} a bias, and the file holds none")
            _set(model, target, GGUFLinear(matrix, bias.detach() if bias is not None else None))
    embedding = model.get_input_embeddings()
    table = _matrix(file, "token_embd.weight", (embedding.num_embeddings, embedding.embedding_dim))
    model.set_input_embeddings(GGUFEmbedding(table))
    head = model.get_output_embeddings()
    head_matrix = (_matrix(file, "output.weight", (head.out_features, head.in_features))
                   if "output.weight" in file.tensors else table)  # tied: the embeddings' own blocks
    model.lm_head = GGUFLinear(head_matrix)
    _set_values(model, "model.norm.weight", file.tensor_values("output_norm.weight"))
    _rebuild_buffers(model)
    missing = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if missing:
        raise ModelFileError(f"{path}: the file gives no values for {', '.join(missing[:4])}"
                             + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    model.eval()
    return GGUFModel(model, tokenizer, folder, file)


def _rebuild_buffers(model: torch.nn.Module) -> None:
    """Buffers computed at construction (the rotary embedding's inverse frequencies) were made on the meta device:
    each module holding one is built again on the CPU from the model's config."""
    for path, module in list(model.named_modules()):
        if any(buffer.is_meta for buffer in module.buffers(recurse=False)) and not isinstance(
                module, (GGUFLinear, GGUFEmbedding)):
            rebuilt = type(module)(config=model.config)
            _set(model, path, rebuilt)


def random_blocks_model(config, attn_implementation: str, type_name: str, seed: int = 0) -> torch.nn.Module:
    """A model of `config`'s shape whose projections, embeddings and head are random blocks of `type_name` in memory
    (snapkv.modeling.gguf_weights.random_matrix), its norms ones and biases zeros: the speed and memory of a GGUF
    file of that shape and type, with no file (answers meaningless). ValueError for a type without blocks."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    generator = torch.Generator().manual_seed(seed)
    embedding = model.get_input_embeddings()
    table = random_matrix(type_name, embedding.num_embeddings, embedding.embedding_dim, generator)
    tied = getattr(config, "tie_word_embeddings", False)
    for path, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear and module is not model.get_output_embeddings():
            bias = torch.zeros(module.out_features) if module.bias is not None else None
            _set(model, path, GGUFLinear(random_matrix(type_name, module.out_features, module.in_features, generator),
                                         bias))
    head = model.get_output_embeddings()
    model.lm_head = GGUFLinear(table if tied else random_matrix(type_name, head.out_features, head.in_features,
                                                                 generator))
    model.set_input_embeddings(GGUFEmbedding(table))
    for path, parameter in list(model.named_parameters()):
        if parameter.is_meta:  # norms and biases
            filled = torch.zeros(parameter.shape) if path.endswith(".bias") else torch.ones(parameter.shape)
            _set(model, path, torch.nn.Parameter(filled, requires_grad=False))
    _rebuild_buffers(model)
    return model.eval()
