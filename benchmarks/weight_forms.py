"""Decode ms/token with the weights in three forms, side by side in one run:

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

    .venv/bin/python benchmarks/weight_forms.py --tokens 7k --budget 1024
"""

import copy
import statistics
import time

import torch
from decode_options import decode_parser
from torch import nn

from snapkv.modeling.block_weights import use_block_weights
from snapkv.compression.config import Cut
from snapkv.io.documents import Document
from snapkv.measure.floor import floor_ms_per_token, read_bandwidth, weight_bytes_per_token
from snapkv.engine.generation import answer
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.engine.models import load_model
from snapkv.session import Session
from snapkv.base.sizes import parse_size

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


def main() -> None:
    parser = decode_parser(__doc__)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
