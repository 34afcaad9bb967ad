"""What a saved cache weighs and what choosing its tier costs: the full cache in 16 bits against stored tiers.

For each length, one haystack document is prefilled (the whole prompt), saved as the full cache in 16 bits,
then each tier is prepared from the document as `snapkv ask` would (prefill + choosing the tier + rounding)
and saved; reported: file bytes and the ratio to the full file, and the prefill and tier seconds against the
plain prefill's. One run, one process, the tiers taking turns.

    .venv/bin/python benchmarks/file_sizes.py --lengths 2k,4k,7k
"""

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from snapkv.compression.config import DEFAULTS
from snapkv.io.documents import Document
from snapkv.io.haystack import build_haystack, filler_text
from snapkv.engine.models import load_model
from snapkv.session import Session
from snapkv.base.sizes import parse_sizes

HALF = replace(DEFAULTS, store_keep=0.5, store_bits=4)
TIERS = {
    "default (whole prompt, 8-bit)": DEFAULTS,
    "pseudo-question 70%, 4-bit": replace(HALF, store_keep=0.7),
    "pseudo-question 50%, 4-bit": replace(HALF, store_method="pseudo-question"),
    "whole prompt, 4-bit": replace(DEFAULTS, store_bits=4),
    "whole prompt, 4/3-bit": replace(DEFAULTS, store_bits="4/3"),
    "whole prompt, 4/2-bit, 20% at 4-bit": replace(DEFAULTS, store_bits="4/2+20%@4"),
    "whole prompt, 3/2-bit, 20% at 8/4-bit": replace(DEFAULTS, store_bits="3/2+20%@8/4"),
    "reconstruction 50%, 4-bit": replace(HALF, store_method="reconstruction"),
    "snapkv document window 50%, 4-bit": replace(HALF, store_method="snapkv"),
    "key-norm 50%, 4-bit": replace(HALF, store_method="key-norm"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2k,4k,7k")
    parser.add_argument("--tiers", default="", help="only the tiers whose name holds one of these, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model()
    print(f"{loaded.name}, {str(loaded.dtype).replace('torch.', '')}")
    print(f"{'tokens':>7}  {'file':<38}{'MiB':>8}{'vs full':>9}{'prefill s':>11}{'tier s':>8}{'(prefill+tier)/plain':>22}")
    with tempfile.TemporaryDirectory() as folder:
        for length in parse_sizes(args.lengths, name="--lengths"):
            document = Document(build_haystack(loaded.tokenizer, filler_text(), length, 0.5, "31415").text)
            full_session = Session(loaded, None)
            prompt = full_session.prompt(document, max_tokens=length)
            full = full_session.prepare(prompt, measure=True)
            full_session.save(full, Path(folder) / "full.snapkv")
            print(f"{prompt.tokens:>7}  {'full cache, 16-bit':<38}{full.file_bytes / 2**20:>8.1f}{1:>8.1f}x"
                  f"{full.prefill_seconds:>11.2f}{0:>8.2f}{1:>21.2f}x")
            for name, settings in TIERS.items():
                if args.tiers and not any(part in name for part in args.tiers.split(",")):
                    continue
                session = Session(loaded, settings)
                prepared = session.prepare(prompt, measure=True)
                session.save(prepared, Path(folder) / "tier.snapkv")
                plain = prepared.prefill_seconds - prepared.tier_seconds
                print(f"{prompt.tokens:>7}  {name:<38}{prepared.file_bytes / 2**20:>8.1f}"
                      f"{full.file_bytes / prepared.file_bytes:>8.1f}x{plain:>11.2f}{prepared.tier_seconds:>8.2f}"
                      f"{prepared.prefill_seconds / full.prefill_seconds:>21.2f}x", flush=True)


if __name__ == "__main__":
    main()
