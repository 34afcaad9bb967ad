"""Which axes to quantize keys and values along: KIVI's (keys per channel, values per token) or others.

For needle documents of the embedded model, the whole prompt's cache is quantized under each scheme and
the question pass is run on it; reported: the KL divergence of the first answer token's distribution from
the 16-bit cache's (mean over documents), whether the greedy answer still holds the needle, and the stored
bits per number (codes plus the fp16 scale and minimum of each group).

    .venv/bin/python benchmarks/quant_axes.py --lengths 2k,7k --bits 4,2
"""

import argparse
from dataclasses import replace

import torch

from snapkv.documents import Document
from snapkv.generation import answer, model_device, run_forward
from snapkv.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.models import load_model
from snapkv.quantize import CHANNELS, TOKENS, Scheme, dequantize, quantize
from snapkv.session import Session
from snapkv.sizes import parse_sizes


def schemes(bits: int, head_dim: int) -> dict[str, tuple[Scheme, Scheme]]:
    return {
        "KIVI: keys per channel (128 tokens), values per token": (Scheme(bits, TOKENS, 128), Scheme(bits, CHANNELS, head_dim)),
        "keys per channel (32 tokens), values per token": (Scheme(bits, TOKENS, 32), Scheme(bits, CHANNELS, head_dim)),
        "both per token (whole head)": (Scheme(bits, CHANNELS, head_dim), Scheme(bits, CHANNELS, head_dim)),
        "both per token (32 channels)": (Scheme(bits, CHANNELS, 32), Scheme(bits, CHANNELS, 32)),
        "both per channel (128 tokens)": (Scheme(bits, TOKENS, 128), Scheme(bits, TOKENS, 128)),
    }


def first_token_logits(loaded, cache, question: torch.Tensor) -> torch.Tensor:
    working = cache.to_dynamic_cache(loaded.model.config)
    positions = torch.arange(cache.original_length, cache.original_length + len(question), device=model_device(loaded.model))
    return run_forward(loaded.model, question.unsqueeze(0), working, positions.unsqueeze(0)).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2k,7k")
    parser.add_argument("--depths", default="20,50,80")
    parser.add_argument("--bits", default="4,2")
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model()
    session = Session(loaded, None)
    question = loaded.prompter.question_ids(NEEDLE_QUESTION, NEEDLE_ANSWER_PREFIX)
    head_dim = loaded.identity["head_dim"]
    results: dict[tuple[int, str], list] = {}
    for length in parse_sizes(args.lengths, name="--lengths"):
        for depth in parse_sizes(args.depths, name="--depths", minimum=0):
            number = str(20000 + length + depth * 97)
            whole = session.prepare(Document(build_haystack(loaded.tokenizer, filler_text(), length, depth / 100,
                                                            number).text)).cache
            reference = first_token_logits(loaded, whole, question).log_softmax(-1)
            for bits in parse_sizes(args.bits, name="--bits"):
                for name, (key_scheme, value_scheme) in schemes(bits, head_dim).items():
                    keys, values, stored = [], [], 0
                    for k, v in zip(whole.keys, whole.values):
                        qk, qv = quantize(k, key_scheme), quantize(v, value_scheme)
                        keys.append(dequantize(qk, k.dtype))
                        values.append(dequantize(qv, v.dtype))
                        stored += qk.nbytes + qv.nbytes
                    quantized = replace(whole, keys=keys, values=values)
                    log_probs = first_token_logits(loaded, quantized, question).log_softmax(-1)
                    kl = float((reference.exp() * (reference - log_probs)).sum())
                    text = loaded.tokenizer.decode(list(answer(loaded.model, quantized, question, max_new_tokens=8)))
                    numbers = sum(k.numel() + v.numel() for k, v in zip(whole.keys, whole.values))
                    results.setdefault((bits, name), []).append((kl, number in text, 8 * stored / numbers))
    print(f"{loaded.name}, {str(loaded.dtype).replace('torch.', '')}: first answer token vs the 16-bit cache")
    print(f"{'bits':>4}  {'scheme':<56}{'mean KL':>10}{'needle found':>14}{'bits/number':>13}")
    for (bits, name), rows in results.items():
        print(f"{bits:>4}  {name:<56}{sum(r[0] for r in rows) / len(rows):>10.4f}"
              f"{sum(r[1] for r in rows):>11}/{len(rows)}{sum(r[2] for r in rows) / len(rows):>13.2f}")


if __name__ == "__main__":
    main()
