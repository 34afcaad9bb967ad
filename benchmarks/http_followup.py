"""A second question about the same document over the OpenAI-compatible API, against the first, as a client sees it.

Starts `snapkv serve --http` (the embedded model unless --model), then with the official `openai` client asks about a
haystack document of --tokens tokens (with a line of its own, so that the first question really prefills): the first
question (prefill, compress, save, answer), then --rounds follow-ups about the same document (its cache reused),
a conversation's second and third turns (the earlier turns appended to a working copy of the document's cache), then
a follow-up asked to cite (snapkv.cite), one more question from a new server process (the cache read back from the
store). Prints each request's wall time, its
time to first token (streamed), the cached tokens the usage reports, and the ratio of the first to the median
follow-up. (The embedded model holds 8,192 tokens: 7500 leaves room for the template and the question.)

    .venv/bin/python benchmarks/http_followup.py --tokens 7500 --rounds 3
"""

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid

import openai

from snapkv.base.sizes import parse_size
from snapkv.io.haystack import NEEDLE_QUESTION, build_haystack, filler_text


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_server(command: list[str]):
    """`snapkv serve --http` on a free port until the block ends: an openai client for it."""
    port = free_port()
    server = subprocess.Popen(command + ["--http", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        for line in server.stderr:
            sys.stderr.write(line)
            if "serving" in line:
                break
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=3600, max_retries=0)
    finally:
        server.terminate()
        server.wait(timeout=30)


def timed(client: openai.OpenAI, model: str, document: str, question: str, max_tokens: int,
          turns: tuple = (), cite: bool = False) -> dict:
    """One streamed request (after the conversation's `turns`, (question, answer) each): wall time, time to first
    token, the answer and the usage; with `cite`, the passages it drew on and the time they took."""
    started = time.perf_counter()
    first, pieces, usage, details = None, [], None, {}
    messages = [{"role": "user", "content": document}]
    for asked, answered in turns:
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    for chunk in client.chat.completions.create(
            model=model, messages=messages + [{"role": "user", "content": question}],
            max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
            extra_body={"snapkv": {"cite": cite}}):
        if chunk.choices and chunk.choices[0].finish_reason:
            details = (chunk.model_extra or {}).get("snapkv", {})
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    ended = time.perf_counter()
    return {"seconds": ended - started, "ttft": (first or ended) - started, "text": "".join(pieces),
            "cached": usage.prompt_tokens_details.cached_tokens, "prompt": usage.prompt_tokens,
            "citations": details.get("citations"), "cite_seconds": details.get("cite_seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8k", help="document length in tokens (default 8k)")
    parser.add_argument("--rounds", type=int, default=3, help="follow-up questions (default 3)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per answer (default 24)")
    parser.add_argument("--model", default=None, help="the model to serve (default: the embedded one)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from transformers import AutoTokenizer  # only to size the haystack as the server will count it

    from snapkv.engine.models import resolve_model_source

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(args.model)[1])
    haystack = build_haystack(tokenizer, filler_text(), parse_size(args.tokens), 0.5, "48613").text
    document = f"Report {uuid.uuid4().hex}.\n\n{haystack}"  # a line of its own: never in the store yet
    command = [sys.executable, "-m", "snapkv_cli", "serve", "--dtype", args.dtype]
    command += ["--model", args.model] if args.model else []
    with running_server(command) as client:
        model = client.models.list().data[0].id
        first = timed(client, model, document, NEEDLE_QUESTION, args.max_tokens)
        followups = [timed(client, model, document, question, args.max_tokens) for question in
                     ([NEEDLE_QUESTION, "What is the special magic number mentioned in the text?"] * args.rounds)
                     [:args.rounds]]
        turn = ((NEEDLE_QUESTION, first["text"]),)  # a conversation: the first question and its answer, then more
        second_turn = timed(client, model, document, "Is that number odd or even?", args.max_tokens, turn)
        turn += (("Is that number odd or even?", second_turn["text"]),)
        third_turn = timed(client, model, document, "Say the number again.", args.max_tokens, turn)
        cited = timed(client, model, document, NEEDLE_QUESTION, args.max_tokens, cite=True)
    with running_server(command) as client:  # a new process: the document's cache comes from the store
        restarted = timed(client, model, document, NEEDLE_QUESTION, args.max_tokens)
    print(f"{model}, a {first['prompt']}-token prompt, {os.cpu_count()} CPUs")
    runs = [("first", first)] + [(f"follow-up {i + 1}", r) for i, r in enumerate(followups)]
    for name, run in runs + [("2nd turn", second_turn), ("3rd turn", third_turn), ("cited", cited),
                             ("restarted", restarted)]:
        print(f"{name:12} {run['seconds']:7.2f} s  first token {run['ttft']:6.2f} s  cached_tokens {run['cached']:6}"
              f"  {run['text'][:60]!r}")
    top = (cited["citations"] or [{}])[0]
    print(f"cited follow-up: the passages took {cited['cite_seconds']} s of its {cited['seconds']:.2f} s; the top one "
          f"{top.get('text', '')[:80]!r} (line {top.get('line')})")
    median = statistics.median(r["seconds"] for r in followups)
    print(f"first / median follow-up: {first['seconds']:.2f} / {median:.2f} s = {first['seconds'] / median:.0f}x")


if __name__ == "__main__":
    main()
