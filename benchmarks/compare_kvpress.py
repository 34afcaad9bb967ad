"""Peer check: snapkv vs kvpress's SnapKVPress on the embedded model, same window, kernel, pooling, ratio.

kvpress pins transformers < 5.3, so it lives in its own virtual environment; this script drives it as a
subprocess and compares, per layer and KV head, the share of kept positions both choose, and the
prefill+compress seconds of each (best of --repeats, one run, same machine).

    python3 -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install "torch==2.13.0+cpu" kvpress==0.5.5
    .venv/bin/python benchmarks/compare_kvpress.py --kvpress-python /tmp/kvpress-venv/bin/python

Kept positions are recovered the same way on both sides: every kept key vector is matched to the
position whose key it equals in the uncompressed cache.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def kept_positions(full_keys, kept_keys):
    """Per head, the positions of `kept_keys` rows in `full_keys`. full: (heads, n, d), kept: (heads, k, d)."""
    import torch

    positions = []
    for head in range(full_keys.shape[0]):
        distance = torch.cdist(kept_keys[head].float(), full_keys[head].float())  # (k, n)
        positions.append(sorted(distance.argmin(dim=1).tolist()))
    return positions


def kvpress_side(args) -> None:
    """Runs in the kvpress environment: prefill with SnapKVPress, report kept positions and seconds."""
    import torch
    from kvpress import SnapKVPress
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(args.threads)
    ids = torch.tensor(json.loads(Path(args.ids).read_text())).unsqueeze(0)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    press = SnapKVPress(compression_ratio=args.ratio, window_size=args.window, kernel_size=args.kernel)
    with torch.no_grad():
        full = DynamicCache()
        model.model(ids, past_key_values=full, use_cache=True)
        seconds = []
        for _ in range(args.repeats):
            cache = DynamicCache()
            started = time.perf_counter()
            with press(model):
                model.model(ids, past_key_values=cache, use_cache=True)
            seconds.append(time.perf_counter() - started)
    layers = [kept_positions(full.layers[i].keys[0], cache.layers[i].keys[0]) for i in range(len(cache.layers))]
    Path(args.out).write_text(json.dumps({"positions": layers, "seconds": min(seconds)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvpress-python", help="python of the environment that has kvpress")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--ratio", type=float, default=0.75, help="share of positions dropped (kvpress's compression_ratio)")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--kernel", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--side", default="snapkv", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "kvpress":
        kvpress_side(args)
        return

    import torch

    from snapkv.config import SnapKVConfig
    from snapkv.documents import Document
    from snapkv.haystack import build_haystack, filler_text
    from snapkv.models import load_model, resolve_model_source
    from snapkv.session import Session

    torch.set_num_threads(args.threads)
    loaded = load_model(dtype="float32", device="cpu")
    document = Document(build_haystack(loaded.tokenizer, filler_text(), args.tokens, 0.5, "48613").text)
    full_session = Session(loaded, None)
    prompt = full_session.prompt(document, max_tokens=args.tokens)  # both sides compress these very ids
    ids, n = prompt.ids, prompt.tokens
    budget = int(n * (1 - args.ratio))
    session = Session(loaded, SnapKVConfig(budget=budget, window=args.window, kernel=args.kernel, pooling="avg",
                                           query_aware=False))
    full = full_session.prepare(prompt).cache
    runs = [session.prepare(prompt, measure=True) for _ in range(args.repeats)]
    ours, seconds = runs[-1].cache, [run.prefill_seconds for run in runs]

    with tempfile.TemporaryDirectory() as folder:
        ids_file, out_file = Path(folder) / "ids.json", Path(folder) / "kvpress.json"
        ids_file.write_text(json.dumps(ids.tolist()))
        subprocess.run([args.kvpress_python, __file__, "--side", "kvpress", "--ids", str(ids_file),
                        "--model-dir", resolve_model_source(None)[1], "--out", str(out_file),
                        "--ratio", str(args.ratio), "--window", str(args.window), "--kernel", str(args.kernel),
                        "--repeats", str(args.repeats), "--threads", str(args.threads)], check=True)
        theirs = json.loads(out_file.read_text())

    agreements = []
    for layer, their_layer in enumerate(theirs["positions"]):
        # our positions come from the engine; recover them from keys too, exactly as on their side
        mine = kept_positions(full.keys[layer], ours.keys[layer])
        assert mine == ours.positions[layer].tolist(), "key matching disagrees with the engine's positions"
        for head, their_head in enumerate(their_layer):
            agreements.append(len(set(mine[head]) & set(their_head)) / max(len(their_head), 1))
    kept_theirs = len(theirs["positions"][0][0])
    print(f"{n} tokens, ratio {args.ratio}, window {args.window}, kernel {args.kernel}, avg pooling: "
          f"kept per head snapkv {budget}, kvpress {kept_theirs}")
    print(f"agreement of kept positions per layer and head: mean {sum(agreements) / len(agreements):.4f}, "
          f"min {min(agreements):.4f} over {len(agreements)} heads")
    print(f"prefill+compress seconds: snapkv {min(seconds):.2f}, kvpress {theirs['seconds']:.2f} "
          f"(ours/theirs {min(seconds) / theirs['seconds']:.3f})")


if __name__ == "__main__":
    sys.exit(main())
