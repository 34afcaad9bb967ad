"""Decode ms/token of snapkv's engines (snapkv.engine.engines) on one prepared cache, side by side in one run:

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

    .venv/bin/python benchmarks/decode_engines.py --tokens 7k --budget 1024
"""

import os
import statistics
import time
from contextlib import contextmanager, nullcontext

from decode_options import decode_parser


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
    from snapkv.engine import engines

    chosen = engines.presize_pays
    engines.presize_pays = lambda *_: False
    try:
        yield
    finally:
        engines.presize_pays = chosen


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


def main() -> None:
    parser = decode_parser(__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compiled", action="store_true", help="leave out the compiled step (its compile takes minutes)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has bf16 units), float32, bfloat16")
    args = parser.parse_args()

    import torch

    from snapkv.modeling.block_weights import FUSED
    from snapkv import native
    from snapkv.engine.compiled import decoder_for
    from snapkv.engine.engines import EngineUse
    from snapkv.compression.config import SnapKVConfig
    from snapkv.io.documents import Document
    from snapkv.measure.floor import floor_ms_per_token, read_bandwidth, weight_bytes_per_token
    from snapkv.engine.generation import answer
    from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
    from snapkv.engine.models import load_model
    from snapkv.session import Session
    from snapkv.base.sizes import parse_size

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


if __name__ == "__main__":
    main()
