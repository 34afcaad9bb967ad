"""snapkv's C kernels (snapkv/kernels/*.c: products with 4/8-bit weight blocks, dequantizing a saved cache, a
question's attention over a long cache and its products with fp32 weights, a decoded token through every layer
of a model on blocks, SnapKV's cut of a layer after a question):
compiled once per machine with the system's C compiler into one shared library, loaded with ctypes.

The library is cached under <snapkv home>/native/, named by a digest of the sources, the compiler and its
flags, so a changed kernel or compiler builds anew (about a second). Nothing depends on it: where there is
no C compiler, the CPU lacks AVX2 and FMA, or compiling fails, `kernels()` raises NativeUnavailable saying
why, and callers stay on PyTorch; `unavailable_reason()` also says when SNAPKV_NATIVE_KERNELS=0 turns
them off (for the weight blocks read where a model is set up, not on every product; for a saved cache on
each restore; for a question's attention on each layer's call; for the decode step on each answer). -ffp-contract=off applies to every file: the
block product's minimum term is a product and a sum, not one FMA (few_rows.c's FMAs are written out).
"""

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

from .ownership import private_folder, written_only_by_me
from .paths import snapkv_home

SOURCES = ("blockwise_matmul.c", "dequantize.c", "few_rows.c", "decode_step.c", "window_cut.c", "coded_attention.c")
HEADERS = ("simd.h", "tiles.h", "hadamard.h")  # included by the sources: written beside them, part of the library's digest
# -ffp-contract=off: a product and a sum written apart stay apart (as in PyTorch), never fused into one FMA
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
DISABLE = "SNAPKV_NATIVE_KERNELS"  # =0 turns the kernels off (measure against PyTorch)
MAX_ROWS = 64  # as in the C source
SCRATCH_PREFIX = "build-"   # a build's scratch folder in the kernels' folder
ABANDONED_SECONDS = 600     # a scratch folder this old is left from a killed build


class NativeUnavailable(RuntimeError):
    """The kernels cannot be used here; the message says why."""


def _compiler() -> str:
    chosen = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not chosen:
        raise NativeUnavailable("no C compiler (cc or gcc) on PATH")
    return chosen


def _cpu_supports_kernels() -> bool:
    import torch

    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build(sources: dict[str, bytes], compiler: str) -> str:
    """The path of the compiled library, compiling it first if these sources (.c files, and the headers they
    include) and compiler have none yet."""
    material = b"".join(name.encode() + text for name, text in sources.items())
    digest = hashlib.sha256(material + compiler.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    try:  # this user's alone: a library another could write or plant here would run inside snapkv
        folder = private_folder(snapkv_home() / "native")
    except OSError as error:
        raise NativeUnavailable(f"the kernels' folder cannot be trusted: {error}") from error
    library = folder / f"kernels-{digest}.so"
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
        try:
            result = subprocess.run([compiler, *FLAGS, *source_files, "-o", built], capture_output=True, text=True,
                                    timeout=120)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise NativeUnavailable(f"could not run the C compiler {compiler}: {error}") from error
        if result.returncode != 0:
            first = (result.stderr.strip().splitlines() or ["no message"])[0]
            raise NativeUnavailable(f"compiling {', '.join(compiled)} failed: {first}")
        os.chmod(built, 0o755)  # no one else may write it, whatever the umask
        os.replace(built, library)  # whole or absent: another process may be loading it
    for obsolete in folder.glob("blockwise_matmul-*.so"):  # the library's name before it held two files
        obsolete.unlink(missing_ok=True)
    return str(library)


def _remove_abandoned_builds(folder: Path) -> None:
    """Scratch folders of builds that were killed (a build that is running takes seconds, not ABANDONED_SECONDS)."""
    for scratch in folder.glob(f"{SCRATCH_PREFIX}*"):
        with contextlib.suppress(OSError):
            if time.time() - scratch.lstat().st_mtime > ABANDONED_SECONDS:
                shutil.rmtree(scratch)


def _load() -> ctypes.CDLL:
    if not _cpu_supports_kernels():
        raise NativeUnavailable("this CPU lacks AVX2 and FMA")
    sources = {name: resources.files("snapkv").joinpath("kernels", name).read_bytes() for name in SOURCES + HEADERS}
    try:
        library = ctypes.CDLL(_build(sources, _compiler()))
    except OSError as error:
        raise NativeUnavailable(f"could not load the compiled kernels: {error}") from error
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.matmul_4bit.argtypes = [pointer, size, size, pointer, pointer, pointer, size, pointer, ctypes.c_int]
    library.matmul_8bit.argtypes = [pointer, size, size, pointer, pointer, size, pointer, ctypes.c_int]
    library.dequantize_rows.argtypes = [pointer, pointer, pointer, size, size, size, ctypes.c_int, ctypes.c_int, size,
                                        size, pointer, pointer, ctypes.c_int, ctypes.c_int]
    library.attend_rows.argtypes = [pointer, size, size, size, ctypes.c_float, pointer, size, pointer, size, size, size,
                                    pointer, pointer, pointer, size, pointer, ctypes.c_int]
    library.attend_coded_and_cut.argtypes = [pointer, size, size, size, ctypes.c_float, size, ctypes.c_int, pointer,
                                             pointer, size, ctypes.c_int, pointer, pointer, pointer, ctypes.c_int,
                                             ctypes.c_int, size, size, pointer, pointer, size, pointer, pointer,
                                             ctypes.c_int]  # snapkv.coded_attention
    library.linear_rows.argtypes = [pointer, size, size, pointer, size, pointer, ctypes.c_int]
    library.linear_rows_blocks.argtypes = [pointer, size, size, ctypes.c_int, pointer, pointer, pointer, size, pointer,
                                           ctypes.c_int]
    library.decode_token.argtypes = [pointer, pointer, size, pointer, pointer, pointer, ctypes.c_int]  # snapkv.native_decode
    library.rope_rows.argtypes = [pointer, size, size, size, pointer, pointer, pointer]  # snapkv.lean_decode
    library.question_before_attention.argtypes = [pointer, pointer, size, pointer, pointer, pointer, pointer, pointer,
                                                   pointer, pointer, ctypes.c_int]  # snapkv.native_decode
    library.question_after_attention.argtypes = [pointer, pointer, size, pointer, pointer, ctypes.c_int]
    library.window_scores.argtypes = [pointer, size, size, size, size, size, size, size, ctypes.c_int, ctypes.c_int,
                                      pointer, ctypes.c_int]  # snapkv.scoring: a cut's scores, positions and rows
    library.top_positions.argtypes = [pointer, size, size, size, size, pointer, ctypes.c_int]
    library.gather_rows.argtypes = [pointer, size, size, size, size, pointer, size, pointer, ctypes.c_int]
    library.mask_positions.argtypes = [pointer, size, size, size, pointer, size]  # snapkv.cachefile, snapkv.quantize
    library.mask_positions.restype = size
    library.part_rows.argtypes = [pointer, size, size, size, pointer, size, pointer, size]
    library.part_columns.argtypes = [pointer, size, size, pointer]
    library.half_all_finite.argtypes = [pointer, pointer, size]  # snapkv.cachefile
    library.half_all_finite.restype = ctypes.c_int
    library.part_columns.restype = None
    library.wide_vectors.argtypes = [ctypes.c_int]  # 1/0: one row with AVX-512 where the CPU has it, or not; -1: ask
    library.wide_vectors.restype = ctypes.c_int
    for function in (library.matmul_4bit, library.matmul_8bit, library.dequantize_rows, library.attend_rows,
                     library.linear_rows, library.linear_rows_blocks, library.decode_token, library.window_scores,
                     library.top_positions, library.gather_rows, library.part_rows, library.rope_rows,
                     library.question_before_attention, library.question_after_attention, library.attend_coded_and_cut):
        function.restype = ctypes.c_int
    return library


_loaded: dict[str, object] = {}  # "library" or "failure": the one attempt of this process


def kernels() -> ctypes.CDLL:
    """The loaded library (matmul_4bit, matmul_8bit, dequantize_rows, attend_rows, linear_rows, linear_rows_blocks,
    decode_token, window_scores, top_positions, gather_rows, mask_positions, part_rows, half_all_finite, rope_rows,
    question_before_attention, question_after_attention, attend_coded_and_cut), or NativeUnavailable. Built and loaded once per process."""
    if "library" not in _loaded and "failure" not in _loaded:
        try:
            _loaded["library"] = _load()
        except NativeUnavailable as error:
            _loaded["failure"] = str(error)
        except Exception as error:  # anything else on the way (an unwritable home folder): the same clean refusal
            _loaded["failure"] = f"{type(error).__name__}: {error}"
    if "failure" in _loaded:
        raise NativeUnavailable(_loaded["failure"])
    return _loaded["library"]


def unavailable_reason() -> str | None:
    """None where the kernels are to be used, else why not."""
    if os.environ.get(DISABLE, "1") == "0":
        return f"turned off by {DISABLE}=0"
    try:
        kernels()
    except NativeUnavailable as error:
        return str(error)
    return None
