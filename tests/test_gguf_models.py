"""A GGUF file's model read in its own blocks (snapkv.engine.gguf_model): tiny Llama, Qwen2 and Qwen3 models written as llama.cpp
writes them, every block type among their matrices, computing what their weights stand for; their answers through the
native engine (C question pass and steps) token for token the torch engine's; and files that disagree with their own
config refused with a message and an exit code."""

import json
import os

import pytest
import torch
from gguf_samples import write_tiny_gguf
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from snapkv import native
from snapkv.base.errors import ModelFileError
from snapkv.compression.config import Cut
from snapkv.engine import native_decode
from snapkv.engine.conversion import embedded_gguf_path
from snapkv.engine.generation import answer, prefill
from snapkv.engine.gguf_model import load_gguf
from snapkv.modeling.architectures import feed_forward_modules
from snapkv.modeling.chunking import chunked_feed_forward
from snapkv.modeling.gguf_weights import GGUFEmbedding, GGUFLinear, GGUFMatrix

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"kernels unavailable: {native.unavailable_reason()}")

VOCAB = 49152  # the embedded model's tokenizer, copied into each file
# each projection in another type: every type a Q4_K_M or Q5_K_M file (and the embedded one) holds
TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q5_0",
         "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q6_K", "output": "Q8_0"}
CONFIGS = {
    "llama": lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
    "qwen2": lambda: Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                                 tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                 max_position_embeddings=4096, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """architecture -> (the file, the transformers model holding the weights it stands for, a snapkv home in which its
    config and tokenizer are converted)."""
    folder = tmp_path_factory.mktemp("gguf-models")
    home = folder / "home"
    made = {}
    previous = os.environ.get("SNAPKV_HOME")
    os.environ["SNAPKV_HOME"] = str(home)
    try:
        for architecture, config in CONFIGS.items():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa").eval()
            for layer in model.model.layers:
                attention = layer.self_attn
                if architecture == "qwen2":  # biases large enough to matter
                    for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
                        torch.nn.init.normal_(linear.bias, std=0.3)
                if architecture == "qwen3":  # norms of each q and k head, not all ones
                    for norm in (attention.q_norm, attention.k_norm):
                        torch.nn.init.normal_(norm.weight, mean=1.0, std=0.3)
            path = folder / f"tiny-{architecture}.gguf"
            write_tiny_gguf(path, model, architecture, TYPES, embedded_gguf_path())
            load_gguf(path, "sdpa")  # the config and tokenizer converted once, here
            made[architecture] = (path, model)
    finally:
        os.environ.pop("SNAPKV_HOME", None) if previous is None else os.environ.__setitem__("SNAPKV_HOME", previous)
    return made, home


@pytest.fixture
def gguf_home(written, monkeypatch):
    monkeypatch.setenv("SNAPKV_HOME", str(written[1]))
    return written[0]


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_the_file_is_read_in_its_own_blocks_and_computes_what_its_weights_stand_for(architecture, gguf_home):
    path, reference = gguf_home[architecture]
    loaded = load_gguf(path, "sdpa")
    model = loaded.model
    linears = [module for module in model.modules() if isinstance(module, GGUFLinear)]
    assert {module.matrix.type_name for module in linears} >= {"Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_0", "Q4_1", "Q8_0"}
    assert isinstance(model.get_input_embeddings(), GGUFEmbedding)
    assert not [name for name, parameter in model.named_parameters() if parameter.dim() > 1]  # no dense matrix at all
    if architecture != "llama":  # tied: the head reads the embeddings' own blocks
        assert model.lm_head.matrix.blocks.data_ptr() == model.get_input_embeddings().matrix.blocks.data_ptr()
    ids = _ids(40, 1).unsqueeze(0)
    with torch.no_grad():
        for rows in (40, 3):  # a tile of dequantized weights; the blocks themselves
            expected, found = reference(ids[:, :rows]).logits, model(ids[:, :rows]).logits
            torch.testing.assert_close(found, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_answers_run_native_and_are_the_torch_engines_token_for_token(architecture, gguf_home, monkeypatch):
    path, _ = gguf_home[architecture]
    model = load_gguf(path, "sdpa").model
    assert native_decode.question_layers(model) is not None  # biases, q/k norms, tied head, parts' types: all in C
    cache = prefill(model, _ids(300, 2), None)
    steps = []
    real_step = native_decode.NativeDecoder.step
    monkeypatch.setattr(native_decode.NativeDecoder, "step", lambda *a: steps.append(1) or real_step(*a))
    for cut in (None, Cut(128, 16)):
        expected = list(answer(model, cache, _ids(10, 3), per_question=cut, max_new_tokens=16, engine="torch"))
        assert not steps
        found = list(answer(model, cache, _ids(10, 3), per_question=cut, max_new_tokens=16))
        assert found == expected
        assert len(steps) == len(found) - 1
        steps.clear()


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_ask_on_a_gguf_file_answers_natively_and_says_how_it_read_the_weights(architecture, gguf_home, cli, tmp_path):
    path, _ = gguf_home[architecture]
    document = tmp_path / "note.txt"
    document.write_text("The harbour authority employed 4,318 people at the end of 2024. " * 20)
    result = cli("ask", "-m", path, document, "How many people did the authority employ?", "--json", "--no-server",
                 "--max-new-tokens", "8")
    assert result.code == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["engine"]["steps"] == "native" and found["engine"]["question"] == "native"
    assert "GGUF file's own blocks" in found["model"]["weights"] and "Q4_K" in found["model"]["weights"]


def test_a_file_that_disagrees_with_its_config_is_refused_with_a_message_and_an_exit_code(gguf_home, cli, tmp_path):
    path, _ = gguf_home["llama"]
    content = bytearray(path.read_bytes())
    key = b"llama.feed_forward_length"
    at = content.index(key) + len(key) + 4  # past the key and its value type: the u32 value
    content[at:at + 4] = (768).to_bytes(4, "little")  # the file's matrices are 512 wide
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(bytes(content))
    with pytest.raises(ModelFileError, match="ffn_gate.weight is \\[512, 256\\] where the model's config needs "
                                             "\\[768, 256\\]"):
        load_gguf(crafted, "sdpa")
    document = tmp_path / "note.txt"
    document.write_text("A short note.")
    result = cli("ask", "-m", crafted, document, "What is it?", "--no-server")
    assert result.code == 3 and "ffn_gate.weight" in result.stderr and "Traceback" not in result.stderr
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:len(content) // 2])
    result = cli("ask", "-m", truncated, document, "What is it?", "--no-server")
    assert result.code == 3 and "truncated" in result.stderr and "Traceback" not in result.stderr


def test_a_qwen3_files_head_size_is_its_own_even_in_a_folder_converted_without_it(gguf_home):
    """transformers reads no key_length for Qwen3 (its default head_dim, 128, whatever the file's): the file's own
    is taken, also over a config folder an older snapkv converted with the default."""
    from snapkv.engine.conversion import gguf_folder

    path, reference = gguf_home["qwen3"]
    config_file = gguf_folder(path, "-config") / "config.json"
    saved = json.loads(config_file.read_text())
    assert saved["head_dim"] == 64
    try:
        config_file.write_text(json.dumps({**saved, "head_dim": 128}))
        model = load_gguf(path, "sdpa").model
        assert model.config.head_dim == 64 and model.model.layers[0].self_attn.q_norm.weight.shape == (64,)
    finally:
        config_file.write_text(json.dumps(saved))


def test_an_mlp_run_in_slices_makes_each_tile_once_and_computes_what_one_pass_does(gguf_home, monkeypatch):
    path, _ = gguf_home["qwen2"]
    model = load_gguf(path, "sdpa").model
    ids = _ids(200, 3).unsqueeze(0)  # slices of more rows than the blocks' own kernels take: tiles
    with torch.no_grad():
        whole = model(ids).logits
    made = []  # the matrix of each tile made
    dequantized = GGUFMatrix.dequantized

    def counted(matrix, dtype=torch.float32):
        made.append(matrix)
        return dequantized(matrix, dtype)

    monkeypatch.setattr(GGUFMatrix, "dequantized", counted)
    with torch.no_grad(), chunked_feed_forward(model, 80):
        sliced = model(ids).logits
    feed_forward = {id(linear.matrix) for mlp in feed_forward_modules(model)
                    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)}
    made_for_mlps = [id(matrix) for matrix in made if id(matrix) in feed_forward]
    assert sorted(made_for_mlps) == sorted(feed_forward)  # three slices, one tile each
    assert all(linear.kept_tiles is None for linear in model.modules() if isinstance(linear, GGUFLinear))
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item())
