"""One decoded row times the embedded model's 4/8-bit blocks, two ways, side by side in one run:

- exact: snapkv's kernel (snapkv/kernels/blockwise_matmul.c): each weight rebuilt in fp32 from its block,
         products summed in fp32; what snapkv decodes with;
- int8:  a candidate (benchmarks/kernels/int8_activations.c): the row rounded to 8 bits per block of 32, then
         integer products (maddubs), as llama.cpp multiplies Q4_1 / Q8_0 matrices on a CPU. Fewer instructions
         per weight, but the arithmetic changes: the needle grid would have to stay equal before snapkv
         could use it.

For each matrix shape of the embedded model (q/k/v fused 576 -> 960, o 576 -> 576, gate/up fused 576 -> 3072,
down 1536 -> 576, the output head 576 -> 49152 in 8 bits), with random codes and scales: microseconds per
product (best of --repeats loops), and each kernel's largest error against the exact fp64 product, relative to
the product's largest value. Compiles the candidate with the system's C compiler into a temporary folder.

    .venv/bin/python benchmarks/int8_activations.py
"""

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from snapkv import native

SHAPES = (("q/k/v", 960, 576, 4), ("o", 576, 576, 4), ("gate/up", 3072, 576, 4), ("down", 576, 1536, 4),
          ("output head", 49152, 576, 8))


def candidate(folder: str) -> ctypes.CDLL:
    here = Path(__file__).parent
    library = Path(folder) / "int8_activations.so"
    subprocess.run(["cc", *native.FLAGS, f"-I{here.parent / 'snapkv' / 'kernels'}",
                    str(here / "kernels" / "int8_activations.c"), "-o", str(library)], check=True)
    loaded = ctypes.CDLL(str(library))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    loaded.matmul_4bit_int8.argtypes = [pointer, size, pointer, pointer, pointer, size, pointer, ctypes.c_int]
    loaded.matmul_8bit_int8.argtypes = [pointer, size, pointer, pointer, size, pointer, ctypes.c_int]
    return loaded


def best_microseconds(product, repeats: int, loops: int) -> float:
    for _ in range(3):
        product()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(loops):
            product()
        best = min(best, (time.perf_counter() - started) / loops)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    exact_kernels = native.kernels()
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        int8_kernels = candidate(folder)
        print(f"{args.threads} threads; us per product (best of {args.repeats}), largest error / largest |y|")
        for name, outputs, inputs, bits in SHAPES:
            blocks = inputs // 32
            x = torch.randn(inputs, generator=generator)
            scale = torch.rand(outputs, blocks, generator=generator) * 0.01
            if bits == 4:
                codes = torch.randint(0, 256, (outputs, inputs // 2), dtype=torch.uint8, generator=generator)
                minimum = -torch.rand(outputs, blocks, generator=generator) * 0.05
                packed = codes.reshape(outputs, blocks, 16)
                q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).double()  # (outputs, blocks, 32)
                weight = q * scale.double()[..., None] + minimum.double()[..., None]
                pointers = (codes.data_ptr(), scale.data_ptr(), minimum.data_ptr())
                exact = lambda y: exact_kernels.matmul_4bit(x.data_ptr(), 1, inputs, *pointers, outputs, y.data_ptr(),
                                                            args.threads)
                rounded = lambda y: int8_kernels.matmul_4bit_int8(x.data_ptr(), inputs, *pointers, outputs,
                                                                 y.data_ptr(), args.threads)
            else:
                codes = torch.randint(-127, 128, (outputs, inputs), dtype=torch.int8, generator=generator)
                weight = codes.double().reshape(outputs, blocks, 32) * scale.double()[..., None]
                exact = lambda y: exact_kernels.matmul_8bit(x.data_ptr(), 1, inputs, codes.data_ptr(), scale.data_ptr(),
                                                            outputs, y.data_ptr(), args.threads)
                rounded = lambda y: int8_kernels.matmul_8bit_int8(x.data_ptr(), inputs, codes.data_ptr(),
                                                                 scale.data_ptr(), outputs, y.data_ptr(), args.threads)
            truth = weight.reshape(outputs, inputs) @ x.double()
            loops = max(5, int(2e8 // (outputs * inputs)))
            figures = {}
            for label, product in (("exact", exact), ("int8", rounded)):
                y = torch.empty(outputs)
                product(y)
                error = float((y.double() - truth).abs().max() / truth.abs().max())
                figures[label] = (best_microseconds(lambda: product(y), args.repeats, loops), error)
            (exact_us, exact_error), (int8_us, int8_error) = figures["exact"], figures["int8"]
            print(f"  {name:<12} {inputs:>5} -> {outputs:<6} {bits}-bit: "
                  f"exact {exact_us:8.0f} us (error {exact_error:.1e}), "
                  f"int8 {int8_us:8.0f} us (error {int8_error:.1e}): {exact_us / int8_us:.2f}x")


if __name__ == "__main__":
    main()
