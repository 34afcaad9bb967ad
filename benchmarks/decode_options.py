"""The command-line options shared by the decode benchmarks (imported by the scripts beside it)."""

import argparse


def decode_parser(description: str) -> argparse.ArgumentParser:
    """--tokens, --budget, --decode-tokens and --repeats, with the script's docstring as its help."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="7k", help="document length: 7000, 7k")
    parser.add_argument("--budget", type=int, default=1024, help="SnapKV positions kept per KV head")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per timed answer")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, the engines taking turns; medians")
    return parser
