"""One decoded row times the embedded model's 4/8-bit blocks, two ways, side by side in one run:

- exact: snapkv's kernel (snapkv/native/kernels/blockwise_matmul.c): each weight rebuilt in fp32 from its block,
         products summed in fp32; what snapkv decodes with;
- int8:  a candidate (benchmarks/kernels/int8_activations.c): the row rounded to 8 bits per block of 32, then
         integer products (maddubs), as llama.cpp multiplies Q4_1 / Q8_0 matrices on a CPU. Fewer instructions
         per weight, but the arithmetic changes: the needle grid would have to stay equal before snapkv
         could use it.

For each matrix shape of the embedded model (q/k/v fused 576 -> 960, o 576 -> 576, gate/up fused 576 -> 3072,
down 1536 -> 576, the output head 576 -> 49152 in 8 bits), with random codes and scales: microseconds per
product (best of --repeats loops), and each kernel's largest error against the exact fp64 product, relative to
the product's largest value. Compiles the candidate with the system's C compiler into a temporary folder.

--needles LENGTHS: also the answers themselves, on the embedded model: a needle document per length and depth
(--depths), prefilled once, its needle question answered with SnapKV (--budget, query-aware) by the lean decode
step twice: with snapkv's exact products and with every decoded row's products by the candidate (the question's
pass, several rows, is the same both ways). Prints each answer pair and whether the needle was found.

    .venv/bin/python benchmarks/int8_activations.py
    .venv/bin/python benchmarks/int8_activations.py --needles 2k,4k,7k --depths 0.1,0.3,0.5,0.7,0.9
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
    subprocess.run(["cc", *native.FLAGS, *native.VARIANT_FLAGS["avx2"], native.OPENMP,
                    f"-I{here.parent / 'snapkv' / 'native' / 'kernels'}",
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


def rounded_products(int8_kernels: ctypes.CDLL, threads: int):
    """A stand-in for snapkv.modeling.block_weights.blockwise_matmul: one row by the candidate, more rows as before."""
    from snapkv.modeling import block_weights

    exact = block_weights.blockwise_matmul

    def product(x: torch.Tensor, blocks, out_features: int) -> torch.Tensor:
        if x.shape[0] != 1:
            return exact(x, blocks, out_features)
        y = torch.empty(1, out_features)
        inputs, codes, scale = x.shape[1], blocks.codes.data_ptr(), blocks.scale.data_ptr()
        if blocks.bits == 4:
            status = int8_kernels.matmul_4bit_int8(x.data_ptr(), inputs, codes, scale, blocks.minimum.data_ptr(),
                                                   out_features, y.data_ptr(), threads)
        else:
            status = int8_kernels.matmul_8bit_int8(x.data_ptr(), inputs, codes, scale, out_features, y.data_ptr(),
                                                   threads)
        if status != 0:
            raise RuntimeError("the candidate kernel refused a product")
        return y

    return product


def compare_answers(int8_kernels: ctypes.CDLL, args) -> None:
    from snapkv.modeling import block_weights
    from snapkv.compression.config import SnapKVConfig
    from snapkv.io.documents import Document
    from snapkv.engine.generation import answer
    from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
    from snapkv.engine.models import load_model
    from snapkv.session import Session
    from snapkv.base.sizes import parse_size

    loaded = load_model()
    print(f"{loaded.name}, {str(loaded.dtype).replace('torch.', '')}; {loaded.weights}")
    question = loaded.prompter.question_ids(NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX)
    session = Session(loaded, SnapKVConfig(budget=args.budget))
    exact_product, found, same = block_weights.blockwise_matmul, {"exact": 0, "int8": 0}, 0
    cells = [(parse_size(length, name="--needles"), float(depth)) for length in args.needles.split(",")
             for depth in args.depths.split(",")]
    rounded = rounded_products(int8_kernels, args.threads)
    for number, (length, depth) in enumerate(cells):
        needle = str(48613 + 7919 * number)
        document = Document(build_haystack(loaded.tokenizer, filler_text(), length, depth, needle).text)
        prepared = session.prepare(session.prompt(document, max_tokens=length))
        texts = {}
        for label in ("exact", "int8"):
            block_weights.blockwise_matmul = exact_product if label == "exact" else rounded
            try:
                tokens = list(answer(loaded.model, prepared.cache, question, per_question=prepared.per_question,
                                     max_new_tokens=12, stop_ids=loaded.stop_ids, engine="torch"))
            finally:
                block_weights.blockwise_matmul = exact_product
            texts[label] = loaded.tokenizer.decode(tokens)
            found[label] += needle in texts[label]
        same += texts["exact"] == texts["int8"]
        print(f"  {prepared.tokens:>5} tokens, depth {depth:.1f}: exact {texts['exact']!r}, int8 {texts['int8']!r}")
    print(f"needle found: exact {found['exact']}/{len(cells)}, int8 {found['int8']}/{len(cells)}; "
          f"the same answer in {same}/{len(cells)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--needles", help="lengths of needle documents whose answers are compared (e.g. 2k,4k)")
    parser.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths, comma-separated")
    parser.add_argument("--budget", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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
        if args.needles:
            compare_answers(int8_kernels, args)


if __name__ == "__main__":
    main()
