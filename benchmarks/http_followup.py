"""A second question about the same document over the OpenAI-compatible API, in every message layout clients send.

Starts `snapkv serve --http` (the embedded model unless --model) and, with the official `openai` client, asks two
questions about a haystack document of --tokens tokens in each layout below, each layout with a document of its own
(a line of its own, so that its first question really prefills):

    script      one user message: the document, a blank line, the question (then the next question the same way,
                the document read with its final newline, as open(f).read() gives it)
    messages    the document in one user message, the question in the next
    llm         llm -s DOCUMENT "Q1", then llm -c "Q2": the system message, then the turns
    open-webui  a file in full context: the RAG block before the question (and the file list in the first request only)
    librechat   a file uploaded as text: "Attached document(s): ```md ...```" then the question; the follow-up after
                the first turn
    continue    @file: a fenced block, then the question; a long system message of rules
    aider       /ask: the files in a user message acknowledged by the assistant; the follow-up after the first turn
    grown       the document, then the same document with a paragraph added (the longest saved prefix reused)

Prints per layout the second question's wall time (the median of --repeats pairs), its cached_tokens against the document's tokens, and the ratio of
its time to the exact hit's (the messages layout's second question); then a question from a new server process (the
cache read back from the store), and the cost of finding the longest saved prefix of a prompt among 1,000 caches.
(The embedded model holds 8,192 tokens: 7000 leaves room for the wrappers, the template and the question.)

    .venv/bin/python benchmarks/http_followup.py --tokens 7000 --repeats 3
"""

import argparse
import contextlib
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import openai

from snapkv.base.sizes import parse_size
from snapkv.io.haystack import NEEDLE_QUESTION, build_haystack, filler_text

SECOND_QUESTION = "What is the special magic number mentioned in the text?"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_server(command: list[str], env: dict | None = None):
    """`snapkv serve --http` on a free port until the block ends (in `env`, default this process's environment): an
    openai client for it."""
    port = free_port()
    server = subprocess.Popen(command + ["--http", str(port)], stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in server.stderr:
            sys.stderr.write(line)
            if "serving" in line:
                break
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=3600, max_retries=0)
    finally:
        server.terminate()
        server.wait(timeout=30)


def timed(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed request: wall time, time to first token, the answer, the usage and snapkv's details."""
    started = time.perf_counter()
    first, pieces, usage, details = None, [], None, {}
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True}):
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
            "document_tokens": details.get("document_tokens"), "source": details.get("cache_source")}


def _m(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def layouts(document: str) -> dict:
    """Per layout, (the first request's messages, the follow-up's given the first answer)."""
    rag = ("### Task:\nRespond to the user query using the provided context, incorporating inline citations.\n\n"
           f'<context>\n<source id="1" name="report.txt">{document}</source>\n</context>\n')
    files = '<attached_files>\n<file type="file" id="1" name="report.txt"/>\n</attached_files>'
    librechat = f'Attached document(s):\n```md# "report.txt"\n{document}\n\n```'
    rules = "<important_rules>\nYou are in chat mode. Answer from the files the user shares.\n</important_rules>"
    aider_files = f"I have *added these files to the chat*.\n\nreport.txt\n```\n{document}\n```\n"
    ack = "Ok, I will use that as the true, current contents of the files."
    q1, q2 = NEEDLE_QUESTION, SECOND_QUESTION
    return {
        "script": ([_m("user", f"{document}\n\n{q1}")], lambda a: [_m("user", f"{document}\n\n\n{q2}\n")]),
        "messages": ([_m("user", document), _m("user", q1)], lambda a: [_m("user", document), _m("user", q2)]),
        "llm": ([_m("system", document), _m("user", q1)],
                lambda a: [_m("system", document), _m("user", q1), _m("assistant", a), _m("user", q2)]),
        "open-webui": ([_m("user", f"{rag}\n{files}\n\n{q1}")],
                       lambda a: [_m("user", f"{files}\n\n{q1}"), _m("assistant", a), _m("user", f"{rag}\n\n{q2}")]),
        "librechat": ([_m("user", f"{librechat}\n{q1}")],
                      lambda a: [_m("user", f"{librechat}\n{q1}"), _m("assistant", a), _m("user", q2)]),
        "continue": ([_m("system", rules), _m("user", f"```report.txt\n{document}\n```\n{q1}")],
                     lambda a: [_m("system", rules), _m("user", f"```report.txt\n{document}\n```\n{q1}"),
                                _m("assistant", a), _m("user", q2)]),
        "aider": ([_m("system", "Act as an expert code analyst."), _m("user", aider_files), _m("assistant", ack),
                   _m("user", f"{q1}\n\n")],
                  lambda a: [_m("system", "Act as an expert code analyst."), _m("user", f"{q1}\n\n"),
                             _m("assistant", a), _m("user", aider_files), _m("assistant", ack),
                             _m("user", f"{q2}\n\n")]),
        "grown": ([_m("user", document), _m("user", q1)],
                  lambda a: [_m("user", document + "\n\nAddendum: the figures above were checked twice."),
                             _m("user", q2)]),
    }


def lookup_cost(caches: int = 1000, tokens: int = 8192) -> tuple[float, float]:
    """Milliseconds to find the longest saved prefix of a prompt among `caches` indexed ones (the median of 50), and
    to look up an exact key, in a folder store."""
    import torch

    from snapkv.storage.store import CacheStore

    store = CacheStore(Path(tempfile.mkdtemp()) / "store")
    store.root.mkdir(parents=True)
    prompts = [torch.randint(0, 50_000, (tokens,), generator=torch.Generator().manual_seed(i)) for i in range(caches)]
    for number, prompt in enumerate(prompts):
        store.path_for(f"{number:032x}").touch()
        store.index_prefixes("seed", prompt, f"{number:032x}")
    grown = torch.cat([prompts[caches // 2][: tokens - 300], torch.arange(500)])
    prefix, exact = [], []
    for _ in range(50):
        started = time.perf_counter()
        assert store.longest_prefix("seed", grown) is not None
        prefix.append(time.perf_counter() - started)
        started = time.perf_counter()
        store.lookup(f"{caches // 2:032x}")
        exact.append(time.perf_counter() - started)
    return statistics.median(prefix) * 1000, statistics.median(exact) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="7000", help="document length in tokens (default 7000)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per answer (default 24)")
    parser.add_argument("--model", default=None, help="the model to serve (default: the embedded one)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--layouts", default=None, help="comma-separated layouts to run (default: all)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="first and second questions per layout, each pair on a new document; the median second "
                             "is shown (default 3)")
    args = parser.parse_args()

    from transformers import AutoTokenizer  # only to size the haystack as the server will count it

    from snapkv.engine.models import resolve_model_source

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(args.model)[1])
    haystack = build_haystack(tokenizer, filler_text(), parse_size(args.tokens), 0.5, "48613").text
    command = [sys.executable, "-m", "snapkv_cli", "serve", "--dtype", args.dtype]
    command += ["--model", args.model] if args.model else []
    results = {}
    with running_server(command) as client:
        model = client.models.list().data[0].id
        for name, (first_messages, follow_up) in layouts("").items():
            if args.layouts and name not in args.layouts.split(","):
                continue
            runs = []
            for _ in range(args.repeats):  # each with a document of its own, the median second kept
                document = f"Report {uuid.uuid4().hex}.\n\n{haystack}"  # a line of its own: never in the store yet
                first_messages, follow_up = layouts(document)[name]
                first = timed(client, model, first_messages, args.max_tokens)
                second = timed(client, model, follow_up(first["text"]), args.max_tokens)
                runs.append((first, second))
                print(f"{name}: first {first['seconds']:.2f} s, second {second['seconds']:.2f} s, cached "
                      f"{second['cached']} of {second['document_tokens']}", file=sys.stderr)
            runs.sort(key=lambda run: run[1]["seconds"])
            results[name] = runs[len(runs) // 2]
        messages = layouts(document)["messages"][0]
    with running_server(command) as client:  # a new process: the document's cache comes from the store
        restarted = timed(client, model, messages, args.max_tokens)
    prefix_ms, exact_ms = lookup_cost()
    print(f"{model}, {os.cpu_count()} CPUs ({platform.machine()}), a {args.tokens}-token document")
    hit = results.get("messages", (None, None))[1]
    print(f"{'layout':12} {'first':>8} {'second':>8} {'cached / document tokens':>26} {'vs hit':>7}  second answer")
    for name, (first, second) in results.items():
        share = second["cached"] / max(second["document_tokens"] or 1, 1)
        ratio = f"{second['seconds'] / hit['seconds']:.2f}x" if hit else "-"
        print(f"{name:12} {first['seconds']:7.2f}s {second['seconds']:7.2f}s {second['cached']:>10} / "
              f"{second['document_tokens']:<6} {share:5.0%} {ratio:>7}  {second['text'][:40]!r}")
    print(f"restarted    {restarted['seconds']:7.2f} s, cached_tokens {restarted['cached']} (read from the store)")
    print(f"longest saved prefix among 1,000 caches: {prefix_ms:.2f} ms a look-up (an exact key: {exact_ms:.3f} ms)")


if __name__ == "__main__":
    main()
