"""The decode step: the engines side by side, the weight forms, and what 8-bit activations would change.

One script, one subcommand per study (each says what it measures with --help):

    engines    decode ms/token of each engine on one prepared cache
    int8       one decoded row times the 4/8-bit blocks: exact against 8-bit activations
    weights    decode ms/token with the weights in three forms

    .venv/bin/python benchmarks/decode.py SUBCOMMAND [OPTIONS]
"""

import argparse
import copy
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from snapkv import native
from snapkv.base.sizes import parse_size
from snapkv.compression.config import Cut
from snapkv.engine.generation import answer
from snapkv.engine.models import load_model
from snapkv.io.documents import Document
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.measure.floor import floor_ms_per_token, read_bandwidth, weight_bytes_per_token
from snapkv.measure.studies import run_study
from snapkv.modeling.block_weights import use_block_weights
from snapkv.session import Session

ENGINES_DOC = """Decode ms/token of snapkv's engines (snapkv.engine.engines) on one prepared cache, side by side in one run:

- concat:    the reference engine (the model's own forward), each token appended by concatenation (a copy of the
  whole cache per token);
- reference: the model's own forward, the cache copied once into a buffer with room for the answer, written in
  place (snapkv's choice except on CPU in 16 bits, where concatenation measured faster);
- torch:     the cache as above, each token through snapkv.engine.lean_decode's written-out step (plain Llama-family
  models on CPU; the model's forward elsewhere), q/k/v and gate/up each read by one product where their
  4/8-bit blocks are fused (snapkv.modeling.block_weights);
- unfused:   the torch engine calling each projection on its own (only where blocks are fused);
- native:    snapkv's default where the weights are blocks: the layers in one C call (snapkv.engine.native_decode), with
  the C kernels' variant SNAPKV_KERNELS=auto chooses; then one row per other variant this CPU runs
  (`native avx2`, `native generic`: snapkv.native);
- compiled:  a torch.compile'd step over a static copy of the cache (snapkv.engine.compiled), its compile time apart.

For the full cache and SnapKV (--budget, query-aware) at --tokens; each engine's answer is checked token for
token against concat's (greedy). The engines take turns, --repeats rounds, medians reported.

    .venv/bin/python benchmarks/decode.py engines --tokens 7k --budget 1024
"""


@contextmanager
def kernels_variant(variant: str):
    """Within the block, the C kernels of `variant` (SNAPKV_KERNELS)."""
    from snapkv import native

    before = os.environ.get(native.SETTING)
    os.environ[native.SETTING] = variant
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(native.SETTING)
        else:
            os.environ[native.SETTING] = before


@contextmanager
def written_by_concatenation():
    """Within the block, every cache layer appended by concatenation (never presized)."""
    from snapkv.engine import working_cache

    chosen = working_cache.presize_pays
    working_cache.presize_pays = lambda *_: False
    try:
        yield
    finally:
        working_cache.presize_pays = chosen


@contextmanager
def projections_one_by_one(model):
    """Within the block, the lean step calls q/k/v and gate/up one by one (their fused blocks set aside)."""
    from snapkv.modeling.block_weights import FUSED

    set_aside = {module: module.__dict__.pop(FUSED) for module in model.modules() if FUSED in module.__dict__}
    try:
        yield
    finally:
        for module, fused in set_aside.items():
            module.__dict__[FUSED] = fused


def run_engines(argv: list[str]) -> None:
    parser = decode_parser(ENGINES_DOC)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compiled", action="store_true", help="leave out the compiled step (its compile takes minutes)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has bf16 units), float32, bfloat16")
    args = parser.parse_args(argv)

    import torch

    from snapkv import native
    from snapkv.base.sizes import parse_size
    from snapkv.compression.config import SnapKVConfig
    from snapkv.engine.compiled import decoder_for
    from snapkv.engine.engines import EngineUse
    from snapkv.engine.generation import answer
    from snapkv.engine.models import load_model
    from snapkv.io.documents import Document
    from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
    from snapkv.measure.floor import floor_ms_per_token, read_bandwidth, weight_bytes_per_token
    from snapkv.modeling.block_weights import FUSED
    from snapkv.session import Session

    torch.set_num_threads(args.threads)
    length = parse_size(args.tokens, name="--tokens")
    loaded = load_model(dtype=args.dtype)
    question = loaded.prompter.question_ids(NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX)
    document = Document(build_haystack(loaded.tokenizer, filler_text(), length, 0.5, "48613").text)
    bandwidth, weights = read_bandwidth(loaded.device), weight_bytes_per_token(loaded.model)
    print(f"{loaded.name}, {str(loaded.dtype).replace('torch.', '')}, {args.threads} threads, "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s, weights {weights / 2**20:.0f} MiB per token")
    for name, settings in (("full cache", None), (f"SnapKV {args.budget}", SnapKVConfig(budget=args.budget))):
        session = Session(loaded, settings)
        prepared = session.prepare(session.prompt(document, max_tokens=length))
        decoder = decoder_for(loaded.model)
        # row: (engine setting, what it runs within)
        engines = {"concat": ("reference", written_by_concatenation), "reference": ("reference", nullcontext),
                   "torch": ("torch", nullcontext), "unfused": ("torch", lambda: projections_one_by_one(loaded.model)),
                   "native": ("native", nullcontext), "compiled": ("compiled", nullcontext)}
        if args.no_compiled:
            del engines["compiled"]
        if not any(FUSED in module.__dict__ for module in loaded.model.modules()):
            del engines["unfused"], engines["native"]
        elif native.unavailable_reason() is None:
            for variant in native.runnable_variants()[1:]:
                engines[f"native {variant}"] = ("native", lambda variant=variant: kernels_variant(variant))
        times = {engine: [] for engine in engines}
        answers, ran = {}, {}
        for round_ in range(args.repeats + 1):  # round 0 warms up (and compiles)
            for engine, (setting, within) in engines.items():
                tokens, first_at, used = [], None, EngineUse()
                with within():
                    for token in answer(loaded.model, prepared.cache, question, per_question=prepared.per_question,
                                        max_new_tokens=args.decode_tokens, engine=setting, used=used):
                        tokens.append(token)
                        if first_at is None:
                            first_at = time.perf_counter()
                    ended = time.perf_counter()
                answers[engine], ran[engine] = tokens, used
                if round_:
                    times[engine].append(1000 * (ended - first_at) / (len(tokens) - 1))
        kv_bytes = prepared.decoded_kv_bytes(question.shape[0])
        floor = floor_ms_per_token(weights, kv_bytes, bandwidth)
        print(f"{name} at {prepared.tokens} tokens (KV decoded against {kv_bytes / 2**20:.1f} MiB, "
              f"floor {floor:.1f} ms/token):")
        for engine in engines:
            median = statistics.median(times[engine])
            same = "same answer" if answers[engine] == answers["concat"] else "DIFFERENT answer"
            what = f"{ran[engine].name}" + (f", {ran[engine].kernels} kernels" if ran[engine].kernels else "")
            print(f"  {engine:<15} {median:7.1f} ms/token  ({median / floor:.1f}x the floor; {same}; ran: {what})")
        if "compiled" in engines:
            print(f"  compile: {decoder.compile_seconds:.1f} s" + (f"; failed: {decoder.failure}" if decoder.failure else ""))


def decode_parser(description: str) -> argparse.ArgumentParser:
    """--tokens, --budget, --decode-tokens and --repeats, with the script's docstring as its help."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="7k", help="document length: 7000, 7k")
    parser.add_argument("--budget", type=int, default=1024, help="SnapKV positions kept per KV head")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per timed answer")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, the engines taking turns; medians")
    return parser


INT8_DOC = """One decoded row times the embedded model's 4/8-bit blocks, two ways, side by side in one run:

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

    .venv/bin/python benchmarks/decode.py int8
    .venv/bin/python benchmarks/decode.py int8 --needles 2k,4k,7k --depths 0.1,0.3,0.5,0.7,0.9
"""


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
    from snapkv.base.sizes import parse_size
    from snapkv.compression.config import SnapKVConfig
    from snapkv.engine.generation import answer
    from snapkv.engine.models import load_model
    from snapkv.io.documents import Document
    from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
    from snapkv.modeling import block_weights
    from snapkv.session import Session

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


def run_int8(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=INT8_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--needles", help="lengths of needle documents whose answers are compared (e.g. 2k,4k)")
    parser.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths, comma-separated")
    parser.add_argument("--budget", type=int, default=1024)
    args = parser.parse_args(argv)
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


WEIGHTS_DOC = """Decode ms/token with the weights in three forms, side by side in one run:

- float:  the weights as loaded (fp32 on a CPU without bf16 units; 4 bytes per weight read per token);
- blocks: snapkv's default on CPU in fp32: the GGUF's own 4-bit (Q4_1) and 8-bit (Q8_0) blocks found back
          exactly from the fp32 weights and multiplied by snapkv's C kernel (snapkv.modeling.block_weights);
- int8:   each nn.Linear's weight rounded to int8 with one scale per output channel (symmetric), multiplied
          by PyTorch's int8 weight-only CPU kernel (torch._weight_int8pack_mm, the one torchao's int8
          weight-only layers use on CPU) for a few rows, dequantized for many (the prompt). On a 2-core AVX2
          CPU in fp32 it read a quarter of the weight bytes yet decoded 1.2-1.3x slower than float (README,
          Measured), so snapkv does not offer it; it stays here for CPUs and kernels where it may pay.

One haystack document at --tokens is prefilled once (original weights); the same cache then answers with
the full cache and with per-question SnapKV (--budget), once per weight form, taking turns for --repeats
rounds (medians). Also: the prefill of the document with each form, the bytes a token reads, the machine's
read bandwidth and the floor, and whether each form found the needle.

    .venv/bin/python benchmarks/decode.py weights --tokens 7k --budget 1024
"""


FEW_ROWS = 64  # at most this many rows multiply by the int8 kernel; more dequantize the weight first


class Int8Linear(nn.Module):
    """nn.Linear with its weight in int8, one scale per output channel.

    weight: (out_features, in_features) int8, a parameter (counted by snapkv.measure.floor as bytes read per token)
    scale:  (out_features,) in the compute dtype: weight ~ int8 * scale
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # (out, in)
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127  # (out,)
        codes = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.scale = nn.Parameter(scale.to(linear.weight.dtype), requires_grad=False)
        self.bias = linear.bias

    def dequantized(self) -> torch.Tensor:
        """(out_features, in_features) in the compute dtype."""
        return self.weight.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (rows, in)
        if rows.shape[0] > FEW_ROWS:
            return nn.functional.linear(x, self.dequantized(), self.bias)
        out = torch._weight_int8pack_mm(rows.contiguous(), self.weight, self.scale)  # (rows, out)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def int8_weights(model: nn.Module) -> int:
    """Every nn.Linear of `model` (the output head included, its tie to the input table cut: the table stays
    as it was, one row read per token) replaced by an Int8Linear, in place; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu":
                setattr(parent, name, Int8Linear(child))
                replaced += 1
    return replaced


def run_weights(argv: list[str]) -> None:
    parser = decode_parser(WEIGHTS_DOC)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    loaded = load_model(block_weights=False)
    forms = {"float": loaded.model, "blocks": copy.deepcopy(loaded.model), "int8": copy.deepcopy(loaded.model)}
    print("blocks:", use_block_weights(forms["blocks"]).describe())
    int8_weights(forms["int8"])
    haystack = build_haystack(loaded.tokenizer, filler_text(), parse_size(args.tokens, name="--tokens"), 0.5, "58207")
    document = Document(haystack.text)
    bandwidth = read_bandwidth(loaded.device)
    print(f"{loaded.name}, {str(loaded.dtype).replace('torch.', '')}, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    prepared, prefill_seconds = {}, {}
    for name, model in forms.items():
        session = Session(type(loaded)(model, loaded.tokenizer, loaded.name, loaded.device, loaded.dtype), None)
        prepared[name] = session.prepare(document, measure=True)
        prefill_seconds[name] = prepared[name].prefill_seconds
    cache = prepared["float"].cache
    question = loaded.prompter.question_ids(NEEDLE_QUESTION, NEEDLE_ANSWER_PREFIX)
    cuts = {"full cache": None, f"snapkv {args.budget}": Cut(args.budget, 32)}
    timings = {(form, cut): [] for form in forms for cut in cuts}
    answers = {}
    for _ in range(args.repeats):
        for cut_name, cut in cuts.items():
            for form, model in forms.items():
                tokens = answer(model, cache, question, per_question=cut, max_new_tokens=args.decode_tokens + 1)
                ids = [next(tokens)]  # the question pass and the first token, not timed
                started = time.perf_counter()
                ids += list(tokens)
                timings[(form, cut_name)].append(1000 * (time.perf_counter() - started) / (len(ids) - 1))
                answers[(form, cut_name)] = loaded.tokenizer.decode(ids)
    kv_bytes = {"full cache": cache.kv_bytes, f"snapkv {args.budget}": cache.kv_bytes * args.budget // cache.original_length}
    print(f"prefill {cache.original_length} tokens: " + ", ".join(
        f"{form} {seconds:.2f} s" for form, seconds in prefill_seconds.items()))
    print(f"{'cache':<14}{'weights':<10}{'MB/token':>10}{'floor ms':>10}{'ms/token':>10}{'x floor':>9}  answer")
    for cut_name in cuts:
        for form, model in forms.items():
            read = weight_bytes_per_token(model) + kv_bytes[cut_name]
            floor = floor_ms_per_token(read, 0, bandwidth)
            ms = statistics.median(timings[(form, cut_name)])
            found = "needle found" if haystack.number in answers[(form, cut_name)] else "needle missed"
            if form != "float":
                found += ", same answer as float" if answers[(form, cut_name)] == answers[("float", cut_name)] else (
                    ", DIFFERENT answer from float")
            print(f"{cut_name:<14}{form:<10}{read / 1e6:>10.0f}{floor:>10.1f}{ms:>10.1f}{ms / floor:>8.1f}x  "
                  f"{found}: {answers[(form, cut_name)].strip()[:40]!r}")


STUDIES = {"engines": run_engines, "int8": run_int8, "weights": run_weights}


if __name__ == "__main__":
    run_study(STUDIES, __doc__)
