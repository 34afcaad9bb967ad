"""The longest prompt that fits: prefill with SnapKV at growing lengths until memory says no.

For each length: the preflight estimate, then (if it fits) a prefill compressed at prefill time (the
document-window tier, so that only one layer's full cache ever exists), the measured peak memory beside
the estimate, and decode ms/token. Stops at the first length the estimate refuses or that runs out of
memory. Meant for a GPU with a random-weights shape:

    python benchmarks/longest_context.py --random-weights samples/configs/llama-3.1-8b.json \
        --budget 4096 --lengths 128k,256k,512k,768k,1m

On CPU, with the tiny shape, it is a quick check of the script itself:

    .venv/bin/python benchmarks/longest_context.py --random-weights samples/configs/tiny-llama.json \
        --lengths 1k,2k --budget 256
"""

import argparse
import json
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-weights", required=True, help="config.json of the model shape")
    parser.add_argument("--lengths", default="128k,256k,512k,768k,1m")
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tokenizer", default=None, help="folder of tokenizer files (default: the embedded model's)")
    args = parser.parse_args()

    import torch

    from snapkv.compression.config import SnapKVConfig
    from snapkv.io.documents import Document
    from snapkv.base.errors import OutOfMemoryError
    from snapkv.engine.memory import check_prefill_fits, is_out_of_memory, release_device_memory
    from snapkv.engine.models import random_weights_model
    from snapkv.session import Prompt, Session
    from snapkv.base.sizes import parse_sizes

    loaded = random_weights_model(args.random_weights, device=args.device, tokenizer=args.tokenizer)
    settings = SnapKVConfig(budget=args.budget, query_aware=False)
    session = Session(loaded, settings, allow_extrapolation=True)
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    rows = []
    for length in parse_sizes(args.lengths, name="--lengths", minimum=16):
        row = {"length": length, "budget": args.budget}
        rows.append(row)
        try:
            estimate = check_prefill_fits(loaded.model, length, loaded.device, loaded.dtype, settings.stored_tier)
        except OutOfMemoryError as error:
            row["refused_by_estimate"] = str(error)
            break
        row["estimate_bytes"] = estimate.total_bytes
        # random token ids of exactly `length` (the answers of random weights are meaningless anyway)
        ids = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(length))
        try:
            prepared = session.prepare(Prompt(Document(""), ids, None), measure=True)
            row["prefill_seconds"] = prepared.prefill_seconds
            row["prefill_peak_bytes"] = prepared.prefill_peak_bytes
            row["kv_bytes"] = prepared.cache.kv_bytes
            stream = session.ask(prepared, "Which number?", max_new_tokens=args.decode_tokens, stop_at_end=False,
                                 measure=True)
            for _ in stream:
                pass
            row["decode_ms_per_token"] = stream.result.decode_ms_per_token
            del prepared
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            release_device_memory(loaded.device)
            row["out_of_memory"] = f"{type(error).__name__}: {str(error)[:200]}"
            break
        print(json.dumps(row), file=sys.stderr, flush=True)
    fitted = [row["length"] for row in rows if "prefill_seconds" in row]
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    print(json.dumps({"model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype),
                      "weights_bytes": weights,  # included in CUDA peaks, not in the estimate
                      "longest_fitted": max(fitted, default=None), "rows": rows}))


if __name__ == "__main__":
    main()
