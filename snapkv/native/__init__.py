"""snapkv's C kernels (snapkv/native/kernels/: products with 4/8-bit weight blocks, dequantizing a saved cache, a question's
attention over a long cache and its products with fp32 weights, a decoded token through every layer of a model on
blocks, SnapKV's cut of a layer after a question): compiled once per machine with the system's C compiler into one
shared library, loaded with ctypes.

One source, three variants. The kernels are written in a small vocabulary of vector operations (f32x8_fma,
f32x16_load, ...), which snapkv/native/kernels/vectors.h maps, one header per vector width, to the CPU's own
instructions or to plain C: `avx512` (lanes8_x86.h, lanes16_avx512.h), `avx2` (lanes8_x86.h; the 16-lane kernels,
such as a question's attention from a saved cache's codes, in plain C: lanes16_plain.h), and `generic` (lanes8_plain.h,
lanes16_plain.h: any C compiler with GCC's vector extensions, gcc or clang, vectorizes them for its target: arm64,
an x86-64 CPU without AVX2). `SNAPKV_KERNELS` chooses: auto (the default: the widest the CPU runs), avx512, avx2,
generic, or off (PyTorch's ops only, to measure against). A build with OpenMP is tried first, then one without (one
thread; clang without libomp).

The library is cached under <snapkv home>/native/, named by its variant and a digest of the sources, the compiler and
its flags, so a changed kernel or compiler builds anew (a few seconds). Nothing depends on it: where there is no C
compiler, the CPU cannot run the variant asked for, or compiling fails, `kernels()` raises NativeUnavailable saying
why, and callers stay on PyTorch. -ffp-contract=off applies to every file: the block product's minimum term is a
product and a sum, not one FMA.

Every exported function and struct is declared in snapkv/native/kernels/kernels.h; BINDINGS below declares the same to
ctypes (tests/test_kernel_interface.py checks them against the header), and the limits are read from the library. Each
vector kernel has a scalar reference in kernels/reference.c, `<kernel>_generic` with the same arguments (REFERENCED),
which snapkv never calls: tests/test_kernel_references.py compares every build's kernel with it.
"""

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

from snapkv.base.ownership import private_folder, written_only_by_me
from snapkv.base.paths import snapkv_home

SOURCES = ("library.c", "blockwise_matmul.c", "dequantize.c", "few_rows.c", "dense_rows.c", "decode_step.c",
           "window_cut.c", "coded_attention.c", "gguf_blocks.c", "reference.c")
HEADERS = ("kernels.h", "vectors.h", "lanes8_x86.h", "lanes8_plain.h", "lanes16_avx512.h", "lanes16_plain.h",
           "plain_lanes.h", "simd.h", "tiles.h", "hadamard.h")  # part of the digest
# -ffp-contract=off: a product and a sum written apart stay apart (as in PyTorch), never fused into one FMA
FLAGS = ("-O3", "-ffp-contract=off", "-Wno-psabi", "-shared", "-fPIC")
OPENMP = "-fopenmp"  # tried first; a compiler without OpenMP builds the same sources for one thread
VARIANT_FLAGS = {
    "avx512": ("-mavx2", "-mfma", "-mf16c"),  # the 16-lane functions carry their own target (lanes16_avx512.h)
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-DSNAPKV_PLAIN_WIDE"),
    "generic": ("-DSNAPKV_PORTABLE",),
}
SETTING = "SNAPKV_KERNELS"  # auto | avx512 | avx2 | generic | off
CHOICES = ("auto", *VARIANT_FLAGS, "off")
SCRATCH_PREFIX = "build-"   # a build's scratch folder in the kernels' folder
ABANDONED_SECONDS = 600     # a scratch folder this old is left from a killed build


class NativeUnavailable(RuntimeError):
    """The kernels cannot be used here; the message says why."""


# ---- the bindings: kernels.h's structs and functions as ctypes declares them ----

_pointer, _size, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class BlockMatrix(ctypes.Structure):
    """kernels.h's block_matrix: a projection in 4/8-bit blocks, plain bf16/fp32 rows (bits 16/32), or a GGUF type's
    blocks (bits 0); `next` the address of the matrix whose outputs follow (0: none)."""


BlockMatrix._fields_ = [("bits", _size), ("codes", _pointer), ("scale", _pointer), ("minimum", _pointer),
                        ("outputs", _size), ("inputs", _size), ("gguf_type", _size), ("row_bytes", _size),
                        ("next", _pointer)]


class DecoderLayer(ctypes.Structure):
    """kernels.h's decoder_layer: one layer's norms, projections and cache buffers."""
    _fields_ = [("input_norm", _pointer), ("post_norm", _pointer), ("qkv", BlockMatrix), ("o", BlockMatrix),
                ("gate_up", BlockMatrix), ("down", BlockMatrix), ("held_keys", _pointer), ("held_values", _pointer),
                ("held", _size), ("held_bits", _size), ("keys", _pointer), ("values", _pointer), ("capacity", _size),
                ("filled", _size), ("qkv_bias", _pointer), ("q_norm", _pointer), ("k_norm", _pointer)]


class DecoderShape(ctypes.Structure):
    """kernels.h's decoder_shape."""
    _fields_ = [("hidden", _size), ("heads", _size), ("kv_heads", _size), ("head_dim", _size),
                ("intermediate", _size), ("norm_eps", _float), ("scaling", _float)]


# name: (result, arguments); every pointer is a c_void_p (struct pointers included)
BINDINGS: dict[str, tuple[object, tuple]] = {
    "kernel_variant": (ctypes.c_char_p, ()),
    "kernel_threads": (_int, ()),
    "wide_vectors": (_int, (_int,)),
    "matmul_4bit": (_int, (_pointer, _size, _size, _pointer, _pointer, _pointer, _size, _pointer, _int)),
    "matmul_8bit": (_int, (_pointer, _size, _size, _pointer, _pointer, _size, _pointer, _int)),
    "linear_rows": (_int, (_pointer, _size, _size, _pointer, _size, _pointer, _int)),
    "linear_rows_blocks": (_int, (_pointer, _size, _size, _int, _pointer, _pointer, _pointer, _size, _pointer, _int)),
    "linear_rows_bf16": (_int, (_pointer, _size, _size, _pointer, _size, _pointer, _int)),
    "matmul_dense": (_int, (_pointer, _size, _size, _pointer, _int, _size, _pointer, _int)),
    "attend_rows": (_int, (_pointer, _size, _size, _size, _float, _pointer, _size, _pointer, _size, _size, _size,
                           _pointer, _pointer, _pointer, _size, _pointer, _int)),
    "attend_coded": (_int, (_pointer, _size, _size, _size, _float, _size, _int, _pointer, _pointer, _size, _int,
                            _pointer, _pointer, _pointer, _size, _pointer, _pointer, _int)),
    "rope_rows": (_int, (_pointer, _size, _size, _size, _pointer, _pointer, _pointer)),
    "decode_token": (_int, (_pointer, _pointer, _size, _pointer, _pointer, _pointer, _int)),
    "final_logits": (_int, (_pointer, _size, _pointer, _float, _pointer, _pointer, _int)),
    "question_before_attention": (_int, (_pointer, _pointer, _size, _pointer, _pointer, _pointer, _pointer, _pointer,
                                         _pointer, _pointer, _int)),
    "question_after_attention": (_int, (_pointer, _pointer, _size, _pointer, _pointer, _int)),
    "window_scores": (_int, (_pointer, _size, _size, _size, _size, _size, _size, _size, _int, _int, _pointer, _int)),
    "chunk_means": (_int, (_pointer, _size, _size, _size)),
    "word_maxima": (_int, (_pointer, _pointer, _size, _size)),
    "top_positions": (_int, (_pointer, _size, _size, _size, _size, _pointer, _int)),
    "gather_rows": (_int, (_pointer, _size, _size, _size, _size, _pointer, _size, _pointer, _int)),
    "dequantize_rows": (_int, (_pointer, _pointer, _pointer, _size, _size, _size, _int, _int, _size, _size, _pointer,
                               _pointer, _int, _int)),
    "dequantize_positions": (_int, (_pointer, _pointer, _int, _pointer, _size, _size, _size, _pointer, _size,
                                    _pointer, _size, _pointer, _int)),
    "mask_positions": (_size, (_pointer, _size, _size, _size, _pointer, _size)),
    "part_rows": (_int, (_pointer, _size, _size, _size, _pointer, _size, _pointer, _size)),
    "part_columns": (None, (_pointer, _size, _size, _pointer)),
    "half_all_finite": (_int, (_pointer, _pointer, _size)),
    "gguf_block_form": (_int, (_int, _pointer, _pointer, _pointer)),
    "gguf_dequantize": (_int, (_int, _pointer, _size, _size, _size, _pointer, _int, _int)),
    "gguf_rows": (_int, (_int, _pointer, _size, _size, _size, _pointer, _size, _pointer)),
    "gguf_matmul": (_int, (_pointer, _size, _size, _int, _pointer, _size, _size, _pointer, _int)),
}
# the vector kernels with a scalar reference (reference.c): `<name>_generic`, the same arguments
REFERENCED = ("matmul_4bit", "matmul_8bit", "linear_rows", "linear_rows_blocks", "linear_rows_bf16", "matmul_dense",
              "attend_rows", "attend_coded", "dequantize_rows", "dequantize_positions", "decode_token",
              "final_logits", "question_before_attention", "question_after_attention", "gguf_matmul")
BINDINGS.update({f"{name}_generic": BINDINGS[name] for name in REFERENCED})
LIMITS = ("snapkv_max_rows", "snapkv_max_attention_head_dim", "snapkv_max_stored_head_dim", "snapkv_max_parts",
          "snapkv_max_decode_head_dim")


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    for name, (result, arguments) in BINDINGS.items():
        function = getattr(library, name)
        function.restype, function.argtypes = result, list(arguments)
    return library


# ---- which variant, built how ----

def _compiler() -> str:
    chosen = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not chosen:
        raise NativeUnavailable("no C compiler (cc, gcc or clang) on PATH")
    return chosen


@functools.lru_cache(maxsize=1)
def _x86_capability() -> str | None:
    """"avx512" (F, BW, VL and DQ), "avx2" (with FMA) or None: what this x86-64 CPU runs; None on other CPUs."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    import torch

    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512" needs F, BW, VL and DQ; "AVX2" needs FMA too
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(capability)


def runnable_variants() -> tuple[str, ...]:
    """The variants this CPU runs, widest first (the suite tests each)."""
    capability = _x86_capability()
    if capability == "avx512":
        return ("avx512", "avx2", "generic")
    if capability == "avx2":
        return ("avx2", "generic")
    return ("generic",)


def setting() -> str:
    """SNAPKV_KERNELS as given (auto when unset); ValueError for a value it does not take."""
    value = os.environ.get(SETTING, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{SETTING}={value} is not one of {', '.join(CHOICES)}")
    return value


def _variant_for(asked: str) -> str:
    """The variant a SNAPKV_KERNELS value asks for on this CPU (off: auto's, for what was set up on the kernels before:
    off is unavailable_reason()'s business), or NativeUnavailable saying why there is none."""
    runnable = runnable_variants()
    if asked in ("auto", "off"):
        return runnable[0]
    if asked not in runnable:
        machine = platform.machine() or "this machine"
        raise NativeUnavailable(f"{SETTING}={asked}: this CPU ({machine}) runs {', '.join(runnable)} only")
    return asked


def _build(sources: dict[str, bytes], compiler: str, variant: str = "generic") -> str:
    """The path of the compiled library of `variant`, compiling it first if these sources (.c files, and the headers
    they include) and compiler have none yet: with OpenMP where the compiler has it, else for one thread."""
    flags = (*FLAGS, *VARIANT_FLAGS[variant], f'-DSNAPKV_VARIANT="{variant}"')
    material = b"".join(name.encode() + text for name, text in sources.items())
    digest = hashlib.sha256(material + compiler.encode() + " ".join(flags).encode()).hexdigest()[:16]
    try:  # this user's alone: a library another could write or plant here would run inside snapkv
        folder = private_folder(snapkv_home() / "native")
    except OSError as error:
        raise NativeUnavailable(f"the kernels' folder cannot be trusted: {error}") from error
    library = folder / f"kernels-{variant}-{digest}.so"
    if written_only_by_me(library):
        return str(library)
    library.unlink(missing_ok=True)  # another's, a link, or writable by others: built again, never loaded
    _remove_abandoned_builds(folder)
    with tempfile.TemporaryDirectory(dir=folder, prefix=SCRATCH_PREFIX) as scratch:
        for name, text in sources.items():
            with open(os.path.join(scratch, name), "wb") as handle:
                handle.write(text)
        compiled = [name for name in sources if name.endswith(".c")]  # headers are only included
        source_files = [os.path.join(scratch, name) for name in compiled]
        built = os.path.join(scratch, "built.so")
        for threading in ((OPENMP,), ()):
            try:
                result = subprocess.run([compiler, *flags, *threading, *source_files, "-o", built],
                                        capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as error:
                raise NativeUnavailable(f"could not run the C compiler {compiler}: {error}") from error
            if result.returncode == 0:
                break
        else:
            first = (result.stderr.strip().splitlines() or ["no message"])[0]
            raise NativeUnavailable(f"compiling {', '.join(compiled)} ({variant}) failed: {first}")
        os.chmod(built, 0o755)  # no one else may write it, whatever the umask
        os.replace(built, library)  # whole or absent: another process may be loading it
    for obsolete in [*folder.glob("blockwise_matmul-*.so"), *folder.glob("kernels-" + "?" * 16 + ".so")]:
        obsolete.unlink(missing_ok=True)  # the library's names before it had variants
    return str(library)


def _remove_abandoned_builds(folder: Path) -> None:
    """Scratch folders of builds that were killed (a build that is running takes seconds, not ABANDONED_SECONDS)."""
    for scratch in folder.glob(f"{SCRATCH_PREFIX}*"):
        with contextlib.suppress(OSError):
            if time.time() - scratch.lstat().st_mtime > ABANDONED_SECONDS:
                shutil.rmtree(scratch)


def _load(variant: str) -> ctypes.CDLL:
    sources = {name: resources.files("snapkv.native").joinpath("kernels", name).read_bytes() for name in SOURCES + HEADERS}
    try:
        library = ctypes.CDLL(_build(sources, _compiler(), variant))
    except OSError as error:
        raise NativeUnavailable(f"could not load the compiled kernels: {error}") from error
    return _bind(library)


_loaded: dict[str, object] = {}  # per variant: its library, or why it failed (one attempt per process)


def _library(variant: str) -> ctypes.CDLL:
    if variant not in _loaded:
        try:
            _loaded[variant] = _load(variant)
        except NativeUnavailable as error:
            _loaded[variant] = str(error)
        except Exception as error:  # anything else on the way (an unwritable home folder): the same clean refusal
            _loaded[variant] = f"{type(error).__name__}: {error}"
    if isinstance(_loaded[variant], str):
        raise NativeUnavailable(_loaded[variant])
    return _loaded[variant]


def kernels() -> ctypes.CDLL:
    """The loaded library of the variant SNAPKV_KERNELS chooses (kernels.h's functions, bound as BINDINGS says), or
    NativeUnavailable. Each variant is built and loaded once per process."""
    try:
        asked = setting()
    except ValueError as error:
        raise NativeUnavailable(str(error)) from error
    return _library(_variant_for(asked))


def unavailable_reason() -> str | None:
    """None where the kernels are to be used, else why not. SNAPKV_KERNELS is read here each time it is asked, off
    included (for the weight blocks where a model is set up, not on every product; for a saved cache on each restore;
    for a question's attention on each layer's call; for the decode step on each answer)."""
    try:
        asked = setting()
        if asked == "off":
            return f"turned off by {SETTING}=off"
        _library(_variant_for(asked))
    except (ValueError, NativeUnavailable) as error:
        return str(error)
    return None


def variant() -> str | None:
    """The variant in use ("avx512", "avx2" or "generic"), or None where the kernels are not."""
    return None if unavailable_reason() else kernels().kernel_variant().decode()


def limit(name: str) -> int:
    """One of the library's limits (LIMITS, kernels.h), e.g. limit("snapkv_max_rows")."""
    if name not in LIMITS:
        raise KeyError(name)
    return ctypes.c_int64.in_dll(kernels(), name).value


def pointer(tensor, dtype, shape: tuple | None = None, *, strided: bool = False) -> int:
    """The address of `tensor` to hand to a kernel, after checking what the kernel assumes: on the CPU, of `dtype`,
    C-contiguous (with `strided`, only along its last axis: the kernel is given the other strides), and of `shape`
    where given (None in it: any size on that axis). ValueError otherwise. Every tensor snapkv hands to C goes
    through here."""
    if tensor.device.type != "cpu":
        raise ValueError(f"a kernel needs a CPU tensor, not one on {tensor.device}")
    if tensor.dtype != dtype:
        raise ValueError(f"a kernel needs {dtype}, not {tensor.dtype}")
    if not ((tensor.stride(-1) == 1 or tensor.shape[-1] == 1) if strided else tensor.is_contiguous()):
        raise ValueError("a kernel needs a tensor contiguous " + ("along its last axis" if strided else "in memory"))
    if shape is not None and (len(shape) != tensor.dim()
                              or any(want is not None and want != have for want, have in zip(shape, tensor.shape))):
        raise ValueError(f"a kernel needs shape {tuple(shape)}, not {tuple(tensor.shape)}")
    return tensor.data_ptr()
