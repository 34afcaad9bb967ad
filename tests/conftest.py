"""Shared fixtures: tiny models of every supported architecture, built in-process, and the embedded model."""

import os
import sys
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              max_position_embeddings=1024, tie_word_embeddings=False)

# name -> config of a tiny random model of that architecture
TINY_CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2),
    "llama-mha": lambda: LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4),
    "mistral": lambda: MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": lambda: Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "phi3": lambda: Phi3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma3": lambda: Gemma3TextConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       sliding_window=16, layer_types=["sliding_attention", "full_attention",
                                                                       "sliding_attention"]),
}


def build_tiny(name: str, attn_implementation: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    config = TINY_CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.eval()


@pytest.fixture(params=sorted(TINY_CONFIGS))
def tiny_model(request):
    return build_tiny(request.param)


@pytest.fixture(autouse=True)
def snapkv_home(tmp_path, monkeypatch):
    """Every test gets its own snapkv home; the embedded model's conversion is shared (see below)."""
    monkeypatch.setenv("SNAPKV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SNAPKV_KEEP_ALIVE", "0")  # an ask starts no background server unless a test asks for one
    monkeypatch.delenv("SNAPKV_MODEL", raising=False)
    return tmp_path / "home"


@pytest.fixture
def vector_width():
    """A setter of whether the C kernels use AVX-512 (where the CPU has it; it returns the choice in force), and the
    kernels' own choice again after the test."""
    from snapkv import native

    library = native.kernels()
    chosen = library.wide_vectors(-1)
    yield lambda wide: bool(library.wide_vectors(int(wide)))
    library.wide_vectors(chosen)


@pytest.fixture(scope="session")
def embedded_home(tmp_path_factory):
    """A snapkv home in which the embedded model has been converted, shared by the whole session."""
    from snapkv.engine.models import convert_gguf, embedded_gguf_path

    home = tmp_path_factory.mktemp("embedded-home")
    previous = os.environ.get("SNAPKV_HOME")
    os.environ["SNAPKV_HOME"] = str(home)
    try:
        convert_gguf(embedded_gguf_path())
    finally:
        if previous is None:
            os.environ.pop("SNAPKV_HOME", None)
        else:
            os.environ["SNAPKV_HOME"] = previous
    return home


@pytest.fixture(scope="session")
def embedded(embedded_home):
    """The embedded SmolLM2 model, loaded once per test session."""
    from snapkv.engine.models import load_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SNAPKV_HOME", str(embedded_home))
        return load_model()


@pytest.fixture
def home(embedded_home, tmp_path, monkeypatch):
    """A fresh snapkv home for CLI tests that shares the converted embedded model."""
    path = tmp_path / "home"
    path.mkdir()
    (path / "models").symlink_to(embedded_home / "models")
    monkeypatch.setenv("SNAPKV_HOME", str(path))
    return path


@pytest.fixture
def tiny_loaded(embedded):
    """A tiny random Llama with the embedded model's real tokenizer (ids beyond the tiny vocab are folded)."""
    from snapkv.engine.models import LoadedModel

    model = build_tiny("llama-gqa")
    model.resize_token_embeddings(len(embedded.tokenizer))
    return LoadedModel(model, embedded.tokenizer, "tiny-llama", torch.device("cpu"), torch.float32)


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run the snapkv entry point in this process, as a user would in a shell: (exit code, stdout, stderr)."""
    from snapkv_cli.app import main

    def run(*args) -> CliResult:
        monkeypatch.setattr(sys, "argv", ["snapkv", *map(str, args)])
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def start_server(home, idle_seconds: int = 120):
    """`snapkv serve` for this home in a child process, once it listens: (the process, the env to reach it)."""
    import subprocess
    import time

    env = {**os.environ, "SNAPKV_HOME": str(home)}
    env.pop("SNAPKV_NO_SERVER", None)
    server = subprocess.Popen([sys.executable, "-m", "snapkv_cli", "serve", "--idle-timeout", str(idle_seconds)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        status = subprocess.run([sys.executable, "-m", "snapkv_cli", "serve", "--status"], env=env,
                                capture_output=True, text=True)
        if status.stdout.startswith("a snapkv server is running") or server.poll() is not None:
            break
        time.sleep(0.2)
    return server, env
