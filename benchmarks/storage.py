"""What is saved: file sizes per tier, the sharper share, and the stored-tier sweep.

One script, one subcommand per study (each says what it measures with --help):

    sizes      file bytes per stored tier, and what choosing the tier costs
    sharp      stored bits side by side, the sharper share included
    tiers      which stored tier to save: needles, many questions and bytes per setting
    simulate   tiers the file cannot hold yet (exact sinks and recent positions, exact outlier key channels,
               keys rounded before RoPE, transform coding), simulated in memory and judged by `snapkv eval fidelity`

    .venv/bin/python benchmarks/storage.py SUBCOMMAND [OPTIONS]
"""

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from snapkv.base.bits import Bits
from snapkv.base.sizes import parse_sizes
from snapkv.compression.config import DEFAULTS
from snapkv.compression.methods import PSEUDO_QUESTIONS, PseudoQuestion
from snapkv.engine.models import load_model
from snapkv.engine.tiers import at_stored_precision
from snapkv.io.documents import Document
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.measure.evaluation import EvalSetting, many_questions, multi_fact_document, needle_grid
from snapkv.measure.studies import run_study
from snapkv.session import Session

SIZES_DOC = """What a saved cache weighs and what choosing its tier costs: the full cache in 16 bits against stored tiers.

For each length, one haystack document is prefilled (the whole prompt), saved as the full cache in 16 bits,
then each tier is prepared from the document as `snapkv ask` would (prefill + choosing the tier + rounding)
and saved; reported: file bytes and the ratio to the full file, and the prefill and tier seconds against the
plain prefill's. One run, one process, the tiers taking turns.

    .venv/bin/python benchmarks/storage.py sizes --lengths 2k,4k,7k
"""


HALF = replace(DEFAULTS, store_keep=0.5, store_bits=4)
SIZE_TIERS = {
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


def run_sizes(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=SIZES_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2k,4k,7k")
    parser.add_argument("--tiers", default="", help="only the tiers whose name holds one of these, comma-separated")
    args = parser.parse_args(argv)
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
            for name, settings in SIZE_TIERS.items():
                if args.tiers and not any(part in name for part in args.tiers.split(",")):
                    continue
                session = Session(loaded, settings)
                prepared = session.prepare(prompt, measure=True)
                session.save(prepared, Path(folder) / "tier.snapkv")
                plain = prepared.prefill_seconds - prepared.tier_seconds
                print(f"{prompt.tokens:>7}  {name:<38}{prepared.file_bytes / 2**20:>8.1f}"
                      f"{full.file_bytes / prepared.file_bytes:>8.1f}x{plain:>11.2f}{prepared.tier_seconds:>8.2f}"
                      f"{prepared.prefill_seconds / full.prefill_seconds:>21.2f}x", flush=True)


SHARP_DOC = """Stored bits side by side on needles and many-facts documents, from one prefill per document.

For each document the whole prompt is prefilled once (16 bits) and rounded to every setting in memory,
as the saved file would hold it: plain bits ("8", "4/3") or a sharper share ("4/2+20%@4": each head's 20%
of positions the pseudo-question probes rank highest in 4 bits, the rest in 4/2; MiKV's idea, arXiv
2402.18096). Every setting answers with per-question SnapKV at the default budget, like the default file;
"full" is the uncompressed cache. The ratio is the stored bytes of the keys and values (codes, scales,
masks) against the full cache in 16 bits.

    .venv/bin/python benchmarks/storage.py sharp --settings 8,4/3,4/2+20%@4,3+20%@4 --lengths 4k,7k
"""


def rounded(loaded, prepared, settings: list[Bits]) -> dict:
    """name -> (the prepared document with its whole cache stored that way, ratio against 16 bits)."""
    whole = prepared.cache  # the whole prompt, 16 bits
    full_bytes = whole.full_kv_bytes(element_size=2)
    found = {"full": (prepared.answering_with(None), 1.0)}
    for bits in settings:
        cache = at_stored_precision(loaded.model, loaded.prompter, whole, bits)
        found[str(bits)] = (replace(prepared, cache=cache), full_bytes / cache.stored_kv_bytes)
    return found


def run_sharp(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=SHARP_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="8,4/3,4/2+20%@4,3+20%@4", help="stored bits, comma-separated")
    parser.add_argument("--lengths", default="4k,7k")
    parser.add_argument("--depths", default="0,10,20,30,40,50,60,70,80,90,100")
    parser.add_argument("--facts", default="4600:8,7200:10", help="TOKENS:COUNT,... many-facts documents")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    settings = [Bits.parse(text) for text in args.settings.split(",")]
    loaded = load_model()
    session = Session(loaded, replace(DEFAULTS, store_bits=16))
    print(f"{loaded.name}, {str(loaded.dtype).replace('torch.', '')}, budget {DEFAULTS.budget}", flush=True)
    needles, facts, ratios = {}, {}, {}
    started = time.perf_counter()
    for length in parse_sizes(args.lengths, name="--lengths", minimum=16):
        for depth in parse_sizes(args.depths, name="--depths", minimum=0):
            number = str(random.Random(length * 1000 + depth).randrange(10000, 99999))
            haystack = build_haystack(loaded.tokenizer, filler_text(), length, depth / 100, number)
            for name, (prepared, ratio) in rounded(loaded, session.prepare(Document(haystack.text)), settings).items():
                text = "".join(session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX,
                                           max_new_tokens=10))
                needles.setdefault(name, []).append(number in text)
                ratios.setdefault(name, []).append(ratio)
        print(f"{length} tokens done ({time.perf_counter() - started:.0f} s)", flush=True)
    for part in filter(None, args.facts.split(",")):
        tokens, count = (int(v) for v in part.split(":"))
        text, document_facts = multi_fact_document(loaded.tokenizer, filler_text(), tokens, count)
        for name, (prepared, _) in rounded(loaded, session.prepare(Document(text)), settings).items():
            answers = ("".join(session.ask(prepared, fact.question, answer_prefix=fact.answer_prefix,
                                           max_new_tokens=10)) for fact in document_facts)
            facts.setdefault(name, []).append(f"{sum(f.number in a for f, a in zip(document_facts, answers))}/{count}")
    print(f"{'stored bits':<16}{'vs 16-bit (shortest-longest)':>30}{'needles':>10}{'facts':>14}")
    for name, ratio in ratios.items():
        print(f"{name:<16}{f'{min(ratio):.2f}-{max(ratio):.2f}x':>30}{sum(needles[name]):>7}/{len(needles[name]):<3}"
              f"{' '.join(facts.get(name, [])):>13}")


TIERS_DOC = """Which stored tier to save by default: the needle grid, many questions and the file bytes of each setting.

Every setting answers with query-aware SnapKV at --budget; they differ in what is saved: the whole prompt
or a share of it chosen by a method (reconstruction, snapkv's document window, pseudo-question, key-norm),
in 16, 8, 4 or 2 bits. Per document the full cache is prefilled once and the tiers are derived from it
(each method scores it once), so a sweep costs about one prefill per document plus the scoring. All of it
goes through snapkv.measure.evaluation (and so Session), as `snapkv eval` does.

    .venv/bin/python benchmarks/storage.py tiers --lengths 2k,4k,7k --depths 10,30,50,70,90 --json sweep.json
"""


# named variants of a method with settings of its own, for --tiers
VARIANTS = {
    "tail": PseudoQuestion(questions=(), tail=32),
    "pq+tail": PseudoQuestion(tail=32),
    "pq2+tail": PseudoQuestion(questions=(*PSEUDO_QUESTIONS, "Summarize the document."), tail=32),
    "pq3+tail": PseudoQuestion(questions=(*PSEUDO_QUESTIONS, "Summarize the document.",
                                          "Who and what does the document name, and where?"), tail=32),
}

# (method, kept share, bits[, pooling kernel]); None for the whole prompt
SWEEP_TIERS = [(None, None, 16), (None, None, 8), (None, None, 4), (None, None, 2),
         ("reconstruction", 0.5, 16), ("reconstruction", 0.5, 8), ("reconstruction", 0.5, 4), ("reconstruction", 0.5, 2),
         ("reconstruction", 0.33, 4), ("reconstruction", 0.25, 4), ("reconstruction", 0.15, 4),
         ("snapkv", 0.5, 4), ("pseudo-question", 0.5, 4), ("key-norm", 0.5, 4)]


def settings(budget: int, tiers: list) -> list[EvalSetting]:
    found = [EvalSetting("full", None)]
    for method, keep, bits, *kernel in tiers:
        config = replace(DEFAULTS, budget=budget, store_keep=keep,
                         store_method=VARIANTS.get(method, method or DEFAULTS.store_method),
                         store_bits=bits, store_kernel=kernel[0] if kernel else None)
        setting = EvalSetting.named(config)
        suffix = (f" [{method}]" if method in VARIANTS else "") + (f" k{kernel[0]}" if kernel else "")
        found.append(EvalSetting(setting.name + suffix, config))
    return found


def run_tiers(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=TIERS_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2k,4k,7k")
    parser.add_argument("--depths", default="10,30,50,70,90")
    parser.add_argument("--budget", type=int, default=DEFAULTS.budget)
    parser.add_argument("--multi-tokens", default="4k")
    parser.add_argument("--facts", type=int, default=8)
    parser.add_argument("--tiers", default=None,
                        help="method:keep:bits[:kernel],... (keep 1 for the whole prompt)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    loaded = load_model()
    tiers = SWEEP_TIERS
    if args.tiers:
        tiers = []
        for part in args.tiers.split(","):
            method, keep, bits, *kernel = part.split(":")
            kernel = [int(k) for k in kernel]
            tiers.append((None, None, int(bits)) if float(keep) >= 1 else (method, float(keep), int(bits), *kernel))
    chosen = settings(args.budget, tiers)
    lengths = parse_sizes(args.lengths, name="--lengths", minimum=16)
    depths = [d / 100 for d in parse_sizes(args.depths, name="--depths", minimum=0)]
    print(f"{loaded.name}, {str(loaded.dtype).replace('torch.', '')}, {len(chosen)} settings", flush=True)
    started = time.perf_counter()
    needles = needle_grid(loaded, lengths, depths, chosen,
                          on_cell=lambda name, n, d: None)
    needle_seconds = time.perf_counter() - started
    started = time.perf_counter()
    multi = many_questions(loaded, parse_sizes(args.multi_tokens, name="--multi-tokens")[0], args.facts, chosen)
    multi_seconds = time.perf_counter() - started
    full_bytes = multi.file_bytes["full"]
    print(f"needle grid {lengths} x {args.depths} ({needle_seconds:.0f} s); {multi.tokens}-token document with "
          f"{len(multi.facts)} facts ({multi_seconds:.0f} s)")
    print(f"{'setting':<52}{'needles':>10}{'per length':>22}{'multi':>8}{'file MiB':>10}{'vs full':>9}")
    for setting in chosen:
        grid = needles.found[setting.name]
        per_length = "/".join(str(sum(row)) for row in grid)
        size = multi.file_bytes[setting.name]
        print(f"{setting.name:<52}{sum(map(sum, grid)):>7}/{len(lengths) * len(depths):<2}{per_length:>22}"
              f"{sum(multi.found[setting.name]):>6}/{len(multi.facts)}{size / 2**20:>10.1f}{full_bytes / size:>8.1f}x")
    if args.json:
        args.json.write_text(json.dumps({"needles": asdict(needles), "multi": asdict(multi),
                                         "settings": [s.name for s in chosen]}, default=str))


SIMULATE_DOC = """Stored tiers the file format cannot hold yet, simulated in memory and judged by `snapkv eval fidelity`.

Each tier of --tier (comma-separated) is rounded as its bits say, then what snapkv.measure.simulated describes is
done: the first --sinks and last --recent positions of each head put back exact, its --key-outliers key channels of
largest magnitude put back exact, the positions whose token is a number's put back exact (--numbers), the keys
rounded before RoPE (--keys-before-rope). With --coded TRANSFORM the tier's rounding is replaced by transform coding
(snapkv.measure.transform_coded: each head's principal components, a Hadamard rotation or its channels, one uniform
step, entropy-coded), the tier's key and value bits then being what a value's code may cost. With --layers only
those layers are rounded. The result is kept in 16 bits, so every question reads these values as it would a real
tier's; the file written is 16-bit, so its size is estimated and printed. The arguments after -- go to `snapkv eval
fidelity` as they are (its --tiers is this --tier). Only --tier is simulated: run the real tier in a run of its own
(`snapkv eval fidelity --tiers TIER`) to compare.

    .venv/bin/python benchmarks/storage.py simulate --tier 8/4g32 --sinks 4 --recent 64 -- \\
        --only mountain_expedition --needle-lengths '' --floor '' -o simulated.json
    .venv/bin/python benchmarks/storage.py simulate --tier 8,4 --coded pca -- --only mountain_expedition ...
"""


def run_simulate(argv: list[str]) -> int:
    from snapkv.engine import tiers
    from snapkv.measure.simulated import Simulation, estimated_ratio, number_tokens, simulated_layer
    from snapkv.measure.transform_coded import TRANSFORMS
    from snapkv_cli.app import main

    split = argv.index("--") if "--" in argv else len(argv)
    ours, theirs = argv[:split], argv[split + 1:]  # this study's arguments, then snapkv eval fidelity's
    parser = argparse.ArgumentParser(description=SIMULATE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    def tiers_of(text: str) -> list[Bits]:
        try:
            chosen = [Bits.parse(part) for part in text.split(",")]
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if any(bits.share for bits in chosen):
            raise argparse.ArgumentTypeError("a sharper share is a tier the file holds: run it with snapkv eval fidelity")
        return chosen

    parser.add_argument("--tier", required=True, type=tiers_of,
                        help="stored bits, as --store-bits (no sharper share), comma-separated")
    parser.add_argument("--sinks", type=int, default=0, help="each head's first positions kept exact")
    parser.add_argument("--recent", type=int, default=0, help="each head's last positions kept exact")
    parser.add_argument("--key-outliers", type=int, default=0, help="key channels per head kept exact")
    parser.add_argument("--keys-before-rope", action="store_true", help="round the keys before RoPE")
    def layer_range(text: str) -> tuple[int, int]:
        first, _, last = text.partition("-")
        if not (first.isdigit() and last.isdigit()) or int(first) > int(last):
            raise argparse.ArgumentTypeError(f"layers as FIRST-LAST, counted from 0 (0-14), not {text!r}")
        return int(first), int(last)

    parser.add_argument("--layers", type=layer_range, default=None,
                        help="round only the layers FIRST-LAST (counted from 0), keep the others as they are")
    parser.add_argument("--numbers", action="store_true",
                        help="keep exact the positions whose token holds a digit (and a number's '.', ',' or '%%')")
    parser.add_argument("--coded", choices=TRANSFORMS, default="",
                        help="transform-code each head instead of rounding it, the bits what a value's code costs")
    args = parser.parse_args(ours)
    if min(args.sinks, args.recent, args.key_outliers) < 0:
        parser.error("--sinks, --recent and --key-outliers count positions or channels: 0 or more")
    simulation = Simulation(args.sinks, args.recent, args.key_outliers, args.keys_before_rope, args.coded,
                            args.numbers, args.layers)
    real = tiers.at_stored_precision

    def simulated(model, prompter, cache, bits, on_step=None):
        bits = Bits.parse(bits)
        if bits not in args.tier:
            return real(model, prompter, cache, bits, on_step)
        is_number = None  # (original_length,) bool: the prompt's number tokens, only where they are kept exact
        if simulation.numbers:
            texts = prompter.tokenizer.convert_ids_to_tokens(cache.token_ids.tolist())
            is_number = number_tokens([prompter.tokenizer.convert_tokens_to_string([text]) for text in texts])
        keys, values, number_shares = [], [], []
        for index, (layer_keys, layer_values, positions) in enumerate(zip(cache.keys, cache.values, cache.positions)):
            if not simulation.rounds_layer(index):
                keys.append(layer_keys)
                values.append(layer_values)
                continue
            # (kv_heads, held, head_dim) each: the rotary embedding at each head's held positions
            rope = model.model.rotary_emb(layer_keys.float(), positions) if args.keys_before_rope else None
            numbers = None if is_number is None else is_number[positions.cpu()]  # (kv_heads, held)
            if numbers is not None:
                number_shares.append(numbers.float().mean().item())
            layer = simulated_layer(layer_keys, layer_values, bits, simulation, rope, numbers)
            keys.append(layer[0].to(layer_keys.dtype))
            values.append(layer[1].to(layer_values.dtype))
        shape = cache.layer_shapes()[0]
        number_share = sum(number_shares) / len(number_shares) if number_shares else 0.0
        rounded_layers = sum(map(simulation.rounds_layer, range(len(cache.keys)))) / len(cache.keys)  # the rest 16-bit
        rounded_ratio = estimated_ratio(bits, simulation, shape[1], shape[2], number_share)
        ratio = 1 / (rounded_layers / rounded_ratio + 1 - rounded_layers)
        numbers_said = f" ({number_share:.1%} of them a number's)" if simulation.numbers else ""
        print(f"simulated {bits} ({simulation.describe()}): about {ratio:.2f}x smaller than 16 bits at "
              f"{shape[1]} positions{numbers_said}", file=sys.stderr, flush=True)
        return replace(cache, keys=keys, values=values, payload=None).at_precision(16)

    tiers.at_stored_precision = simulated
    sys.argv = ["snapkv", "eval", "fidelity", *theirs, "--tiers", ",".join(map(str, args.tier))]
    try:
        main()
    except SystemExit as exit:
        if exit.code not in (0, None):
            return exit.code if isinstance(exit.code, int) else 1
    output = next((theirs[i + 1] for i, a in enumerate(theirs[:-1]) if a in ("-o", "--output")), None)
    if output:  # the results say which tier was simulated, and how
        results = json.loads(Path(output).read_text())
        results["simulated"] = {"tiers": [str(bits) for bits in args.tier], "simulation": simulation.describe(),
                                **asdict(simulation)}
        Path(output).write_text(json.dumps(results))
    return 0


STUDIES = {"sizes": run_sizes, "sharp": run_sharp, "tiers": run_tiers, "simulate": run_simulate}


if __name__ == "__main__":
    run_study(STUDIES, __doc__)
