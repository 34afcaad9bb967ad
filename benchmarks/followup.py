"""Where a follow-up question's time goes, from the library, the shell and the OpenAI-compatible API.

One script, one subcommand per study (each says what it measures with --help):

    parts      each part of a follow-up (restore, question pass, first token) with and without a change
    shell      a follow-up from the shell as typed, with the server and without, wall clock
    http       a second question over the OpenAI-compatible API, in every message layout clients send

    .venv/bin/python benchmarks/followup.py SUBCOMMAND [OPTIONS]
"""

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import openai
import torch

from snapkv import native
from snapkv.base.sizes import parse_size
from snapkv.compression import compress
from snapkv.compression.config import DEFAULTS
from snapkv.engine.models import load_model
from snapkv.io.documents import Document
from snapkv.io.haystack import NEEDLE_ANSWER_PREFIX, NEEDLE_QUESTION, build_haystack, filler_text
from snapkv.measure.bench import NEEDLE_NUMBER
from snapkv.measure.studies import run_study
from snapkv.session import Session
from snapkv.storage.cachefile import load_cache

PARTS_DOC = """Where a follow-up question's time goes, each part with and without a change, side by side.

One document is prefilled once and saved with the default stored bits; then, taking turns for --rounds rounds:
- restore: load_cache with snapkv's C dequantizer (snapkv/native/kernels/dequantize.c) and with PyTorch's ops
  (SNAPKV_KERNELS=off for that call);
- question pass + first token, over the cache loaded as `ask` loads it (with room for the question) unless said:
    C attention, into the room: the question's attention by snapkv/native/kernels/few_rows.c over a deferred cache, each
        layer restored into one buffer and the question written into its room (snapkv.storage.deferred): what snapkv does;
    C attention, appended: the same over a cache restored whole at load (each layer copied to append the question);
    matmuls, into the room: PyTorch's matmuls for the attention (SNAPKV_KERNELS=off for the pass);
    scored from scratch: SnapKV's scores computed again from the window's queries, not taken from the pass.
Medians are printed, with each one's ratio to the first, and whether every way found the needle.

    .venv/bin/python benchmarks/followup.py parts --tokens 8k --rounds 5
"""


@contextmanager
def kernels_off(off: bool):
    if off:
        os.environ[native.SETTING] = "off"
    try:
        yield
    finally:
        os.environ.pop(native.SETTING, None)


def timed_restore(path: Path, identity: dict, dtype: torch.dtype, native_kernels: bool) -> float:
    with kernels_off(not native_kernels):
        started = time.perf_counter()
        load_cache(path, identity=identity, dtype=dtype)
        return time.perf_counter() - started


@contextmanager
def scoring_from_scratch(on: bool):
    real = compress._window_attention
    if on:  # what the layer's attention kept is not handed on: the window's queries are made again
        compress._window_attention = lambda captured, *rest: real(None, *rest)
    try:
        yield
    finally:
        compress._window_attention = real


def timed_question(session: Session, prepared) -> tuple[float, str]:
    stream = session.ask(prepared, NEEDLE_QUESTION, answer_prefix=NEEDLE_ANSWER_PREFIX, max_new_tokens=6,
                         measure=True)
    text = "".join(stream)
    return stream.result.ttft_seconds, text


def run_parts(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=PARTS_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="7k")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    loaded = load_model()
    tokens = parse_size(args.tokens)
    print(f"embedded model, {str(loaded.dtype).replace('torch.', '')}; {loaded.weights}; "
          f"C kernels: {native.unavailable_reason() or 'available'}")
    session = Session(loaded, replace(DEFAULTS, budget=args.budget), allow_extrapolation=True)
    document = Document(build_haystack(loaded.tokenizer, filler_text(), tokens, 0.5, NEEDLE_NUMBER).text)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "document.snapkv"
        built = session.prepare(session.prompt(document, max_tokens=tokens))
        session.save(built, path)
        prepared = session.load_file(path, check_sources=False)
        print(f"{built.tokens} tokens prefilled in {built.prefill_seconds:.1f} s; stored "
              f"{built.cache.tier.bits} bits, {path.stat().st_size / 2**20:.1f} MiB")
        appended = replace(prepared, cache=load_cache(path, identity=loaded.identity, dtype=loaded.dtype)[0])
        ways = {  # name: (prepared document, kernels off, scored from scratch)
            "C attention, into the room": (prepared, False, False),
            "C attention, appended": (appended, False, False),
            "matmuls, into the room": (prepared, True, False),
            "scored from scratch": (prepared, False, True),
        }
        restore = {True: [], False: []}
        question = {name: [] for name in ways}
        answers = {}
        for _ in range(args.rounds):
            for flag in (True, False):
                restore[flag].append(timed_restore(path, loaded.identity, loaded.dtype, flag))
            for name, (document, off, scratch) in ways.items():
                with kernels_off(off), scoring_from_scratch(scratch):
                    seconds, answers[name] = timed_question(session, document)
                question[name].append(seconds)
    new, old = statistics.median(restore[True]), statistics.median(restore[False])
    print(f"load_cache: C dequantizer {new:.3f} s, PyTorch ops {old:.3f} s ({old / new:.2f}x) "
          f"[{', '.join(f'{x:.3f}' for x in restore[True])} | {', '.join(f'{x:.3f}' for x in restore[False])}]")
    first = statistics.median(question[next(iter(ways))])
    for name, seconds in question.items():
        median = statistics.median(seconds)
        print(f"question pass + first token, {name}: {median:.3f} s ({median / first:.2f}x) "
              f"[{', '.join(f'{x:.3f}' for x in seconds)}]; answer {answers[name].strip()!r}, "
              f"needle {'found' if NEEDLE_NUMBER in answers[name] else 'missed'}")


SHELL_DOC = """A follow-up question from the shell, wall clock from process start to last byte, in one run:

1. as typed, with the defaults: the first `snapkv ask` on a document (imports, model load, prefill, stored
   tier, save; it leaves a server keeping the model loaded), then a second `snapkv ask` on it (runs on that
   server: a store hit with the model already loaded);
2. the same two with --no-server (SNAPKV_NO_SERVER=1): every ask a new process that loads the model.

Each ask is a real process, as a user types it (no options but --json, to read its parts); the embedded
model's conversion is done beforehand (it happens once per machine).

    .venv/bin/python benchmarks/followup.py shell --tokens 7000
"""


QUESTION = "What is the special magic number?"


def timed_ask(document: Path, env: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "snapkv_cli", "ask", str(document), QUESTION, "--json"],
                            capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"ask failed: {result.stderr}")
    return seconds, json.loads(result.stdout)


def fresh_home(folder: Path, name: str, model: Path) -> Path:
    home = folder / name
    (home / "models").mkdir(parents=True)
    (home / "models" / model.name).symlink_to(model)
    return home


def show(name: str, seconds: float, report: dict, first: float) -> None:
    timings, answer = report["timings"], report["answers"][0]
    print(f"{name:<44}{seconds:7.2f} s  {first / seconds:6.1f}x  (model load {timings['model_load_seconds']:.2f} s, "
          f"prefill {timings['prefill_seconds']:.2f} s, cache load {report['cache']['load_seconds']:.2f} s, first "
          f"token {answer['ttft_seconds']:.2f} s, {answer['new_tokens']} tokens at "
          f"{answer['decode_tokens_per_second']:.1f}/s)")


def run_shell(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=SHELL_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7000)
    args = parser.parse_args(argv)
    from snapkv.engine.models import load_model, resolve_model_source
    from snapkv.io.haystack import build_haystack, filler_text

    model = Path(resolve_model_source(None)[1])  # converts the embedded model once, if it was not yet
    tokenizer = load_model().tokenizer
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        document = folder / "report.txt"
        document.write_text(build_haystack(tokenizer, filler_text(), args.tokens, 0.5, "58207").text)
        base = {k: v for k, v in os.environ.items() if k not in ("SNAPKV_NO_SERVER", "SNAPKV_KEEP_ALIVE")}
        typed = {**base, "SNAPKV_HOME": str(fresh_home(folder, "typed", model)), "SNAPKV_NOLOG": "1"}
        try:
            first, first_report = timed_ask(document, typed)
            second, second_report = timed_ask(document, typed)
        finally:
            subprocess.run([sys.executable, "-m", "snapkv_cli", "serve", "--stop"], env=typed, capture_output=True)
        local = {**typed, "SNAPKV_HOME": str(fresh_home(folder, "local", model)), "SNAPKV_NO_SERVER": "1"}
        local_first, local_first_report = timed_ask(document, local)
        local_hit, local_hit_report = timed_ask(document, local)
    reports = (first_report, second_report, local_first_report, local_hit_report)
    found = all("58207" in r["answers"][0]["answer"] for r in reports)
    same = len({r["answers"][0]["answer"] for r in reports}) == 1
    print(f"{first_report['document']['tokens']}-token document, {first_report['compression']['mode']}; needle "
          f"{'found' if found else 'MISSED'} in all four answers, which are {'identical' if same else 'NOT identical'}")
    print(f"{'':<44}{'wall':>9}  {'vs first':>7}")
    show("first ask, as typed (starts the server)", first, first_report, first)
    show("second ask, as typed (on that server)", second, second_report, first)
    show("first ask, --no-server", local_first, local_first_report, local_first)
    show("second ask, --no-server (store hit)", local_hit, local_hit_report, local_first)


HTTP_DOC = """A second question about the same document over the OpenAI-compatible API, in every message layout clients send.

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

    .venv/bin/python benchmarks/followup.py http --tokens 7000 --repeats 3
"""


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


def run_http(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=HTTP_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="7000", help="document length in tokens (default 7000)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per answer (default 24)")
    parser.add_argument("--model", default=None, help="the model to serve (default: the embedded one)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--layouts", default=None, help="comma-separated layouts to run (default: all)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="first and second questions per layout, each pair on a new document; the median second "
                             "is shown (default 3)")
    args = parser.parse_args(argv)

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


STUDIES = {"parts": run_parts, "shell": run_shell, "http": run_http}


if __name__ == "__main__":
    run_study(STUDIES, __doc__)
