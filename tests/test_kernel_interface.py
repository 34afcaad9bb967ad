"""The C kernels' one interface (snapkv/native/kernels/kernels.h) against its Python side (snapkv.native): every function and
struct the header declares is bound as the header says, the limits come from the library, each variant this CPU runs
builds and loads, and a compiler without OpenMP still builds them."""

import ctypes
import re
from importlib import resources

import pytest
import torch

from snapkv import native

HEADER = resources.files("snapkv.native").joinpath("kernels", "kernels.h").read_text()
has_kernels = native.unavailable_reason() is None
needs_kernels = pytest.mark.skipif(not has_kernels, reason=f"no C kernels: {native.unavailable_reason()}")

C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "void": None}


def _declarations() -> dict[str, tuple[str, list[str]]]:
    """name -> (result type, argument types) of every function kernels.h declares, comments dropped."""
    text = re.sub(r"/\*.*?\*/", "", HEADER, flags=re.S)
    text = re.sub(r"typedef struct \{.*?\}\s*\w+;", "", text, flags=re.S)
    found = {}
    for result, name, arguments in re.findall(r"^([\w ]+?\**)\s*\b(\w+)\(([^)]*)\);", text, flags=re.M):
        parts = [] if arguments.strip() == "void" else [a.strip() for a in arguments.split(",")]
        found[name] = (result.strip(), parts)
    return found


def _ctype(declaration: str):
    """A C type (with or without a parameter name) as ctypes sees it: every pointer a c_void_p."""
    if "*" in declaration:
        return ctypes.c_char_p if declaration.startswith("const char") else ctypes.c_void_p
    words = declaration.replace("const ", "").split()
    return C_TYPES[words[0]]


def _structs() -> dict[str, list[tuple[str, str]]]:
    """struct name -> [(field, C type)] in order."""
    text = re.sub(r"/\*.*?\*/", "", HEADER, flags=re.S)
    structs = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\}\s*(\w+);", text, flags=re.S):
        fields = []
        for line in body.split(";"):
            line = line.strip()
            if not line:
                continue
            kind, names = re.match(r"((?:const )?\w+)\s+(.*)", line).groups()
            for field in names.split(","):
                field = field.strip()
                fields.append((field.lstrip("*"), kind + ("*" if field.startswith("*") else "")))
        structs[name] = fields
    return structs


def test_every_function_of_the_header_is_bound_as_declared():
    declared = _declarations()
    assert set(declared) == set(native.BINDINGS), set(declared) ^ set(native.BINDINGS)
    for name, (result, arguments) in declared.items():
        bound_result, bound_arguments = native.BINDINGS[name]
        assert bound_result == _ctype(result), name
        assert list(bound_arguments) == [_ctype(a) for a in arguments], name


def test_every_struct_of_the_header_is_mirrored_field_by_field():
    mirrors = {"block_matrix": native.BlockMatrix, "decoder_layer": native.DecoderLayer,
               "decoder_shape": native.DecoderShape}
    structs = _structs()
    assert set(structs) == set(mirrors)
    for name, fields in structs.items():
        mirrored = mirrors[name]._fields_
        assert [field for field, _ in fields] == [field for field, _ in mirrored], name
        for (field, kind), (_, ctype) in zip(fields, mirrored):
            expected = {"block_matrix": native.BlockMatrix}.get(kind, ctypes.c_void_p if "*" in kind else None)
            expected = expected or C_TYPES[kind.replace("const ", "")]
            assert ctype is expected, (name, field)


@needs_kernels
def test_the_limits_come_from_the_library_as_the_header_defines_them():
    defined = dict(re.findall(r"#define SNAPKV_(MAX_\w+) (\d+)", HEADER))
    for name in native.LIMITS:
        assert native.limit(name) == int(defined[name.removeprefix("snapkv_").upper()])
    with pytest.raises(KeyError):
        native.limit("snapkv_max_anything")


@needs_kernels
@pytest.mark.parametrize("variant", native.runnable_variants() if has_kernels else [])
def test_each_variant_this_cpu_runs_builds_loads_and_says_what_it_is(variant, monkeypatch):
    monkeypatch.setenv(native.SETTING, variant)
    library = native.kernels()
    assert native.variant() == variant == library.kernel_variant().decode()
    assert library.kernel_threads() == 1  # gcc here: built with OpenMP
    assert bool(library.wide_vectors(-1)) == (variant == "avx512")  # 16 lanes by default where they are the CPU's


def test_the_setting_is_checked_and_the_cpu_decides_what_runs(monkeypatch):
    monkeypatch.setenv(native.SETTING, "sse9")
    assert "SNAPKV_KERNELS=sse9 is not one of auto, avx512, avx2, generic, off" in native.unavailable_reason()
    monkeypatch.setenv(native.SETTING, "off")
    assert native.unavailable_reason() == "turned off by SNAPKV_KERNELS=off" and native.variant() is None
    monkeypatch.setattr(native, "_x86_capability", lambda: "avx2")  # an AVX2-only CPU
    monkeypatch.setenv(native.SETTING, "avx512")
    assert "runs avx2, generic only" in native.unavailable_reason()
    monkeypatch.setattr(native, "_x86_capability", lambda: None)  # arm64
    assert native.runnable_variants() == ("generic",)
    monkeypatch.setenv(native.SETTING, "auto")
    assert native._variant_for(native.setting()) == "generic"


@needs_kernels
def test_a_compiler_without_openmp_builds_the_kernels_for_one_thread(monkeypatch, tmp_path):
    """A compiler that refuses -fopenmp (clang without libomp) builds the same sources without it."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "OPENMP", "-fno-such-openmp-flag")
    monkeypatch.setenv(native.SETTING, "generic")
    library = native.kernels()
    assert library.kernel_threads() == 0 and native.variant() == "generic"
    x, weight = torch.randn(3, 64), torch.randn(16, 64)
    y = torch.empty(3, 16)
    assert library.linear_rows(x.data_ptr(), 3, 64, weight.data_ptr(), 16, y.data_ptr(), 2) == 0
    torch.testing.assert_close(y, x @ weight.T, rtol=1e-5, atol=1e-5)


def test_a_tensor_is_checked_before_it_is_handed_to_c():
    rows = torch.zeros(4, 8)
    assert native.pointer(rows, torch.float32, (4, None)) == rows.data_ptr()
    with pytest.raises(ValueError, match="float32"):
        native.pointer(rows.to(torch.bfloat16), torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        native.pointer(rows.T, torch.float32)
    with pytest.raises(ValueError, match=r"shape \(4, 9\)"):
        native.pointer(rows, torch.float32, (4, 9))
    with pytest.raises(ValueError, match="shape"):
        native.pointer(rows, torch.float32, (4, 8, 1))
    heads = torch.zeros(2, 10, 8)[:, :6]  # (2, 6, 8), heads 80 floats apart: rows whole, the kernel told the stride
    assert native.pointer(heads, torch.float32, (2, 6, 8), strided=True) == heads.data_ptr()
    with pytest.raises(ValueError, match="contiguous in memory"):
        native.pointer(heads, torch.float32)
    with pytest.raises(ValueError, match="along its last axis"):
        native.pointer(heads.transpose(1, 2), torch.float32, strided=True)


def test_every_tensor_handed_to_c_goes_through_the_checked_helper():
    """No module passes a tensor's raw address to a kernel: data_ptr() appears only in native.pointer (and where
    addresses are compared, never passed: which tensors share memory)."""
    import re
    from pathlib import Path

    package = Path(native.__file__).parent.parent
    comparing = {"storage/deferred.py", "measure/bench.py", "measure/floor.py"}  # identity checks, no kernel call
    raw = [f"{path.relative_to(package)}:{number}" for path in package.rglob("*.py")
           if path.relative_to(package).as_posix() not in comparing | {"native/__init__.py"}
           for number, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\.data_ptr\(\)", line)]
    assert not raw, raw
    source = (package / "native" / "__init__.py").read_text()
    assert source.count(".data_ptr()") == 1  # pointer's own return


KERNEL_TESTS = ("test_block_weights.py", "test_kernel_references.py", "test_native_decode.py", "test_dense_weights.py",
                "test_coded_attention.py", "test_tiers.py", "test_engine.py", "test_config_and_scoring.py",
                "test_gguf_blocks.py", "test_gguf_models.py")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", (native.runnable_variants()[1:] if has_kernels else []))
def test_the_kernel_tests_pass_with_every_other_variant_this_cpu_runs(variant, tmp_path):
    """The suite runs with the variant auto chooses; the tests of what the kernels compute run again here with each
    other variant this CPU runs (in a child, SNAPKV_KERNELS set), so that none is left untested."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    environment = {**os.environ, native.SETTING: variant, "SNAPKV_HOME": str(tmp_path / "home")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                             *[str(here / name) for name in KERNEL_TESTS]], capture_output=True, text=True,
                            env=environment, cwd=here.parent, timeout=1100)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1]


def _attention_and_products(seed: int, head_dim: int, tokens: int) -> dict[str, torch.Tensor]:
    """few_rows.c's two entry points on fixed random inputs, with the variant SNAPKV_KERNELS names: a question's
    attention (kv_heads 2, 3 query heads each, a question of 7 tokens, a window of 4) over `tokens` keys, and a
    linear layer from 4-bit and from 8-bit blocks."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads, group, question, window = 2, 3, 7, 4
    rows = group * question
    query = torch.randn(kv_heads, rows, head_dim, generator=generator)
    keys, values = (torch.randn(kv_heads, tokens, head_dim, generator=generator) for _ in range(2))
    tail = torch.zeros(question, question).masked_fill_(torch.ones(question, question).triu(1).bool(), float("-inf"))
    weights = torch.empty(kv_heads, rows, tokens)
    out = torch.empty(kv_heads, rows, head_dim)
    sums = torch.empty(kv_heads, group, tokens)
    library = native.kernels()
    assert library.attend_rows(query.data_ptr(), kv_heads, rows, question, 0.125, keys.data_ptr(), tokens * head_dim,
                               values.data_ptr(), tokens * head_dim, tokens, head_dim, tail.data_ptr(),
                               weights.data_ptr(), out.data_ptr(), window, sums.data_ptr(), 2) == 0
    found = {"attention": out, "window_sums": sums}
    x = torch.randn(5, 96, generator=generator)
    for bits in (4, 8):
        codes = torch.randint(0, 256, (40, 96 // 2 if bits == 4 else 96), dtype=torch.uint8, generator=generator)
        scale = torch.rand(40, 3, generator=generator) / 50
        minimum = -torch.rand(40, 3, generator=generator) / 10 if bits == 4 else None
        y = torch.empty(5, 40)
        assert library.linear_rows_blocks(x.data_ptr(), 5, 96, bits, codes.data_ptr(), scale.data_ptr(),
                                          minimum.data_ptr() if minimum is not None else None, 40, y.data_ptr(),
                                          2) == 0
        found[f"linear_{bits}bit"] = y
    return found


@needs_kernels
@pytest.mark.parametrize("head_dim, tokens", [(64, 300), (80, 517)])
def test_every_variant_this_cpu_runs_gives_a_questions_attention_and_products_the_same_sums(head_dim, tokens,
                                                                                             monkeypatch):
    """The builds compute the same sums in the same order (tile widths, runs of values and 4-lane helpers differ):
    avx512 and avx2 give the same bits; generic the same where its target fuses multiply-adds (arm64), else (x86-64's
    SSE2 has no fused multiply-add) within rounding. Checked against PyTorch too. 300 and 517 tokens: runs of values
    that do not divide them, tiles of keys left part full; head_dim 80: AVX-512's 64 columns and 16 more."""
    import platform

    results = {}
    for variant in native.runnable_variants():
        monkeypatch.setenv(native.SETTING, variant)
        results[variant] = _attention_and_products(7, head_dim, tokens)
    monkeypatch.delenv(native.SETTING)
    fused = {"avx512", "avx2"} | ({"generic"} if platform.machine().lower() in ("aarch64", "arm64") else set())
    exact = [variant for variant in results if variant in fused]
    for variant in exact[1:]:
        for name, tensor in results[exact[0]].items():
            assert torch.equal(tensor, results[variant][name]), f"{variant} {name} differs from {exact[0]}'s"
    for variant in results:
        for name, tensor in results[exact[0] if exact else variant].items():
            torch.testing.assert_close(results[variant][name], tensor, rtol=1e-5, atol=1e-5)

    generator = torch.Generator().manual_seed(7)  # the same inputs, for PyTorch's answer
    query = torch.randn(2, 21, head_dim, generator=generator)
    keys, values = (torch.randn(2, tokens, head_dim, generator=generator) for _ in range(2))
    scores = (query * 0.125) @ keys.transpose(1, 2)  # (kv_heads, rows, tokens)
    own = torch.ones(7, 7).triu(1).bool().repeat(3, 1)  # (rows, question): each row's later question tokens
    scores[:, :, tokens - 7:] = scores[:, :, tokens - 7:].masked_fill(own, float("-inf"))
    softmax = scores.softmax(-1)
    for variant, found in results.items():
        torch.testing.assert_close(found["attention"], softmax @ values, rtol=1e-4, atol=1e-5)
        window_sums = softmax.view(2, 3, 7, tokens)[:, :, 3:].sum(2)  # the question's last 4 rows, per query head
        torch.testing.assert_close(found["window_sums"], window_sums, rtol=1e-4, atol=1e-6)
