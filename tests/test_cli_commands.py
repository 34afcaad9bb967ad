"""compress, info, cache and repl, driven in-process with CliRunner, on the embedded model."""

import itertools
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner


from snapkv.storage.cachefile import read_metadata
from snapkv.compression.config import DEFAULTS
from snapkv.base.errors import ConfigError, DocumentError
from snapkv_cli.app import app
from snapkv_cli.render import inert

SAMPLE = Path(__file__).parent.parent / "samples" / "annual_report.txt"
REVENUE = "What was the revenue for the 2023 financial year?"


def invoke(*args, input=None):
    return CliRunner().invoke(app, list(args), input=input, catch_exceptions=False)


def test_inert_text():
    assert inert("a\x1b[31mred\x1b[0m [bold]b[/bold]\x07\n\tc") == "a[31mred[0m [bold]b[/bold]\n\tc"


@pytest.mark.slow
def test_info_shows_what_was_measured_for_a_default_file(home, tmp_path):
    """A file made with the defaults: `info` shows the figures `snapkv eval fidelity` measured for its own model, bits,
    cut and system message (its stored bits against 16 bits, its cut against the full cache), not another's."""
    output = tmp_path / "report.snapkv"
    assert invoke("compress", str(SAMPLE), "--output", str(output)).exit_code == 0
    described = json.loads(invoke("info", str(output), "--json").stdout)
    kinds = {entry["kind"]: entry for entry in described["fidelity"]}
    assert "compression" in kinds and set(kinds) <= {"storage", "compression"}
    assert kinds.get("storage", {"bits": str(DEFAULTS.store_bits)})["bits"] == str(DEFAULTS.store_bits)
    for entry in kinds.values():
        assert (entry["budget"], entry["method"], entry["whole_words"]) == (
            DEFAULTS.budget, DEFAULTS.method, DEFAULTS.whole_words)
        assert entry["model"] == "SmolLM2-135M-Instruct" and entry["system_sha256"] == described["system_sha256"]
    human = " ".join(invoke("info", str(output)).stdout.split())
    assert f"the cut to {DEFAULTS.budget}, whole words against the full cache" in human


@pytest.mark.slow
def test_compress_info_and_cache_commands(home, tmp_path):
    output = tmp_path / "report.snapkv"
    result = invoke("compress", str(SAMPLE), "--output", str(output), "--budget", "256", "--no-query-aware")
    assert result.exit_code == 0, result.output
    assert "positions per KV head per layer" in result.stderr and output.is_file()
    described = json.loads(invoke("info", str(output), "--json").stdout)
    assert described["mode"] == "document-window" and max(described["kept_per_layer"]) == 256
    assert described["tier"]["cut"]["budget"] == 256 and described["per_question"] is None
    assert described["sources"][0]["name"] == str(SAMPLE)
    human = invoke("info", str(output))
    assert "SmolLM2-135M-Instruct" in human.stdout and "document-window" in human.stdout
    # no figures were measured for a document-window cut to 256: said so, none borrowed from other settings
    assert described["storage"]["bits"] == DEFAULTS.store_bits.to_json()  # 8 as a number, 16/8 as text
    assert described["fidelity"] == [] and len(described["system_sha256"]) == 64
    assert "not measured for these settings" in " ".join(human.stdout.split())
    # the store: one entry from an ask, listed, removed; clear
    invoke("ask", str(SAMPLE), REVENUE, "--json", "--budget", "256")
    entries = json.loads(invoke("cache", "list", "--json").stdout)
    assert len(entries) == 1 and entries[0]["bytes"] > 0
    # what the file stores, and when, in a form people and scripts read
    import datetime

    assert entries[0]["bits"] == str(DEFAULTS.store_bits) and entries[0]["tier"] == "whole prompt"
    assert datetime.datetime.fromisoformat(entries[0]["modified_iso"]).timestamp() == int(entries[0]["modified"])
    assert f" {DEFAULTS.store_bits} " in invoke("cache", "list").stdout and " whole prompt " in invoke("cache", "list").stdout
    assert "1 cache," in invoke("cache", "list").stdout
    assert invoke("cache", "rm", entries[0]["key"][:10]).exit_code == 0
    assert json.loads(invoke("cache", "list", "--json").stdout) == []
    invoke("ask", str(SAMPLE), REVENUE, "--json", "--budget", "256")
    assert "removed 1" in invoke("cache", "clear", "--yes").stdout


def answered(*args) -> dict:
    result = invoke("ask", *args, "--json", "--max-new-tokens", "24")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--budget", "256"], ["--budget", "256", "--no-query-aware"]],
                         ids=["query-aware", "document-window"])
def test_compress_then_ask_the_file_answers_as_ask_the_document(home, tmp_path, flags):
    saved = tmp_path / "report.snapkv"
    assert invoke("compress", str(SAMPLE), "-o", str(saved), *flags).exit_code == 0
    from_document = answered(str(SAMPLE), REVENUE, *flags, "--no-store")
    from_file = answered(str(saved), REVENUE)  # no flags: the file says how it is answered
    assert from_file["answers"][0]["answer"] == from_document["answers"][0]["answer"]
    if "--no-query-aware" not in flags:  # a document-window cut at 256 loses this answer, by either road
        assert "184.6" in from_file["answers"][0]["answer"]
    for key in ("mode", "kept_tokens", "stored_tokens", "budget", "kernel"):
        assert from_file["compression"][key] == from_document["compression"][key], key


@pytest.mark.slow
def test_asking_a_file_with_flags_that_contradict_it(home, tmp_path):
    wide, narrow, whole = tmp_path / "wide.snapkv", tmp_path / "narrow.snapkv", tmp_path / "whole.snapkv"
    assert invoke("compress", str(SAMPLE), "-o", str(wide), "--budget", "512").exit_code == 0
    assert invoke("compress", str(SAMPLE), "-o", str(narrow), "--budget", "512", "--no-query-aware").exit_code == 0
    # a smaller per-question budget is applied: the whole-prompt tier is cut to it per question
    smaller = answered(str(wide), REVENUE, "--budget", "256")
    assert smaller["compression"]["kept_tokens"] == 256 and smaller["compression"]["mode"] == "query-aware"
    # a document-window file asked with a smaller budget is cut further per question, and says so
    result = invoke("ask", str(narrow), REVENUE, "--budget", "256", "--max-new-tokens", "4")
    assert result.exit_code == 0 and "cuts it further" in result.stderr
    # more than the file holds, or a mode the file cannot give: refused, naming both
    with pytest.raises(ConfigError, match=r"holds a document-window cache.*512.*--budget 1024 asks for more"):
        invoke("ask", str(narrow), REVENUE, "--budget", "1024", "--query-aware")
    assert invoke("compress", str(SAMPLE), "-o", str(whole), "--budget", "512", "--store-keep", "1").exit_code == 0
    with pytest.raises(ConfigError, match=r"holds a query-aware cache \(whole prompt.*--no-query-aware asks for a "
                                          r"document-window cache"):
        invoke("ask", str(whole), REVENUE, "--no-query-aware")
    with pytest.raises(ConfigError, match=r"--store-\* options describe another stored tier"):
        invoke("ask", str(wide), REVENUE, "--store-bits", "4")  # the file holds the default, 8
    with pytest.raises(ConfigError, match=r"holds a document-window cache.*--no-compress asks for the full cache"):
        invoke("ask", str(narrow), REVENUE, "--no-compress")


@pytest.mark.slow
def test_the_repl_saves_what_the_cache_holds(home, tmp_path):
    """/query-aware off, then /save: the file says what it holds, answered as it is (not the default budget it never
    had): for a whole-prompt cache, and for the default stored tier."""
    saved = tmp_path / "after.snapkv"
    result = invoke("repl", str(SAMPLE), "--store-keep", "1", "--store-bits", "16",
                    input=f"/query-aware off\n/save {saved}\n/exit\n")
    assert result.exit_code == 0, result.output
    described = json.loads(invoke("info", str(saved), "--json").stdout)
    assert described["mode"] == "full" and described["tier"]["cut"] is None and described["per_question"] is None
    assert min(described["kept_per_layer"]) == described["original_length"]
    human = invoke("info", str(saved)).stdout
    assert "whole prompt" in human and "the cache as it is" in human and str(DEFAULTS.budget) not in human
    tier = tmp_path / "tier.snapkv"
    assert invoke("repl", str(SAMPLE), "--store-keep", "0.7", "--store-bits", "4",
                  input=f"/query-aware off\n/save {tier}\n").exit_code == 0
    described = json.loads(invoke("info", str(tier), "--json").stdout)
    assert described["mode"] == "tier-only" and described["per_question"] is None
    assert described["tier"]["cut"]["method"] == "pseudo-question" and described["tier"]["bits"] == 4
    assert described["fidelity"] == []  # a tier-only file at 4 bits was not measured, and info says so
    assert "not measured for these settings" in " ".join(invoke("info", str(tier)).stdout.split())
    assert max(described["kept_per_layer"]) < described["original_length"]


def test_compress_refuses_to_overwrite_a_foreign_file(home, tmp_path):
    precious = tmp_path / "notes.snapkv"
    precious.write_text("my notes")
    with pytest.raises(Exception, match="refusing to overwrite"):
        invoke("compress", str(SAMPLE), "--output", str(precious))
    assert precious.read_text() == "my notes"


@pytest.mark.slow
def test_repl_through_stdin(home, tmp_path):
    saved = tmp_path / "from-repl.snapkv"
    script = "\n".join([REVENUE, "/budget 512", "/query-aware off", "/stats", "Where will the next annual \\",
                        "general meeting be held?", f"/save {saved}", "/nonsense", "/exit", "never asked"]) + "\n"
    result = invoke("repl", str(SAMPLE), input=script)
    assert result.exit_code == 2, result.output  # a /command failed (/nonsense): a script can tell
    assert "184.6" in result.stdout and "Wick" in result.stdout
    assert "budget 512" in result.stderr and "query-aware off" in result.stderr
    assert "unknown command /nonsense" in result.stderr
    assert saved.is_file()
    assert "never asked" not in result.stdout


@pytest.mark.slow
def test_repl_stats_after_turns_say_what_the_answer_read_and_what_the_file_holds(home, tmp_path):
    """Three turns, then /set budget 256: /stats tells the cut over the document and the turns, what the last answer
    read per token, and what the file stores for the document, each once (not the working copy's size as stored)."""
    script = "\n".join([REVENUE, "/stats", "What is the net debt?", "Who chairs the board?", "/set budget 256",
                        "How many staff are there?", "/stats", "/exit"]) + "\n"
    result = invoke("repl", str(SAMPLE), "--max-new-tokens", "12", input=script)
    assert result.exit_code == 0, result.output
    # the two /stats, then the table the REPL prints at its end
    first, last = [" ".join(part.split("peak memory")[0].split()) for part in result.stderr.split("document     ")[1:3]]
    assert "kept 256 per head per layer" in last and "the conversation's 3 turns" in last
    assert "KV read" in last and "what the last answer decoded against" in last
    stored = re.search(r"stored (\S+) MiB of keys and values \(8-bit\) for the document", last)
    assert stored and stored.group(0) in first  # the file's, as before the turns: not the working copy's
    read = float(re.search(r"KV read (\S+) MiB per answer token", last).group(1))
    assert read < float(stored.group(1))  # 256 positions and the question, against the whole document in the file
    assert last.count("MiB") == 4  # KV read, stored (the document and its full cache), the cache file: each once


@pytest.mark.slow
def test_repl_stats_of_the_last_answer_load_clear_and_the_log(home, tmp_path, monkeypatch):
    """/stats tells of the last answer (not of a budget set since), /save leaves how the cache was obtained as it
    was, /load answers from another file, /clear forgets the answers; each answer is logged with absolute paths."""
    from snapkv.logbook import Logbook

    monkeypatch.chdir(tmp_path)
    script = "\n".join([REVENUE, "/budget 512", "/stats", "/save notes", "/stats", "/load notes.snapkv",
                        "What is the net debt?", "/stats", "/clear", "/stats", "/exit"]) + "\n"
    result = invoke("repl", str(SAMPLE), "--max-new-tokens", "24", input=script)
    assert result.exit_code == 0, result.output
    labels = ("kept", "KV read", "stored", "prefill", "cache", "answer", "peak memory", " ")
    tables = ["\n".join(itertools.takewhile(lambda line: line.startswith(labels), part.splitlines()[1:]))
              for part in result.stderr.split("document     ")[1:]]  # the rows of each /stats
    assert len(tables) == 4
    assert "kept         everything" in tables[0] and "512 per head" not in tables[0] and "answer " in tables[0]
    assert tables[1] == tables[0]  # a /save changes nothing /stats tells
    assert "kept         512 per head" in tables[2] and "answer " in tables[2]
    assert "answer " not in tables[3]  # /clear forgot the answers
    assert "cleared" in result.stderr and "tokens ready from notes.snapkv" in result.stderr
    logged = Logbook().entries()
    assert [entry["question"] for entry in logged] == ["What is the net debt?", REVENUE]
    assert logged[0]["cache_path"] == str(tmp_path / "notes.snapkv")


@pytest.mark.slow
def test_ctrl_c_mid_answer_keeps_the_cache_and_the_session(home, tmp_path, monkeypatch):
    """Ctrl-C at the third decoded token of the first answer; the REPL goes on, and the cache it saves
    afterwards is bit for bit the one saved to the store before any answer."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    from snapkv.engine import lean_decode, native_decode

    real_forward, real_step, decode_steps = LlamaForCausalLM.forward, lean_decode.decode_step, []
    real_native_step = native_decode.NativeDecoder.step

    def decode_step_begins() -> None:
        decode_steps.append(1)
        if len(decode_steps) == 3:
            raise KeyboardInterrupt

    def forward(self, *args, **kwargs):
        if kwargs["input_ids"].shape[1] == 1:  # one new token through the model's forward: a decode step
            decode_step_begins()
        return real_forward(self, *args, **kwargs)

    def lean_step(*args):  # a decode step through snapkv.engine.lean_decode (Llama-family models on CPU)
        decode_step_begins()
        return real_step(*args)

    def native_step(self, *args):  # a decode step in one C call (the default for the embedded model in fp32)
        decode_step_begins()
        return real_native_step(self, *args)

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    monkeypatch.setattr(lean_decode, "decode_step", lean_step)
    monkeypatch.setattr(native_decode.NativeDecoder, "step", native_step)
    after = tmp_path / "after.snapkv"
    result = invoke("repl", str(SAMPLE), input=f"{REVENUE}\n{REVENUE}\n/save {after}\n")
    assert result.exit_code == 0, result.output
    assert "answer stopped" in result.stderr
    assert "184.6" in result.stdout  # the second, uninterrupted answer
    [stored] = (home / "caches").glob("*.snapkv")
    assert read_metadata(after)["payload_sha256"] == read_metadata(stored)["payload_sha256"]


@pytest.mark.slow
def test_ask_shows_markup_and_escapes_inert(home):
    question = "What was the revenue? \x1b[2J[bold red]loud[/bold red]"
    result = invoke("ask", str(SAMPLE), question, "--budget", "256", "--max-new-tokens", "5")
    assert result.exit_code == 0
    assert "[bold red]loud[/bold red]" in result.stderr and "\x1b[2J" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("side", ["start", "middle", "end"])
def test_document_longer_than_the_context_is_refused_or_cut(home, tmp_path, side):
    long_document = tmp_path / "long.txt"
    long_document.write_text(SAMPLE.read_text() * 10)
    with pytest.raises(DocumentError, match=r"holds 8192 tokens.*--truncate"):
        invoke("ask", str(long_document), "q", "--no-store")
    result = invoke("ask", str(long_document), REVENUE, "--truncate", side, "--json", "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "cut by" in result.stderr and f"({side})" in result.stderr
    report = json.loads(result.stdout)
    assert report["document"]["tokens"] == 8192 - 128 and report["document"]["truncated_tokens"] > 0
    # the saved file records the cut, and `info` says what was cut
    path = report["cache"]["path"]
    assert read_metadata(path)["tier"]["truncation"] == {"side": side,
                                                           "tokens": report["document"]["truncated_tokens"]}
    assert f"at the {side}" in " ".join(invoke("info", path).stdout.split())  # as read, the table's folds undone


def test_info_groups_identical_layers():
    from snapkv_cli.info import _runs, _span

    runs = _runs([(64, 10), (64, 10), (32, 6), (64, 10)])
    assert runs == [(0, 1, (64, 10)), (2, 2, (32, 6)), (3, 3, (64, 10))]
    assert [_span(first, last) for first, last, _ in runs] == ["layers 0-1", "layer 2", "layer 3"]


@pytest.mark.slow
def test_the_repl_is_a_conversation_until_clear_and_saves_the_document_alone(home, tmp_path):
    """Each answer becomes a turn the next question sees (/show counts them), /clear starts a new conversation, and
    /save saves the document's cache, not the conversation's."""
    saved = tmp_path / "document.snapkv"
    script = "\n".join([REVENUE, "And the year before?", "/show", f"/save {saved}", "/clear", "/show", "/exit"]) + "\n"
    result = invoke("repl", str(SAMPLE), "--max-new-tokens", "24", input=script)
    assert result.exit_code == 0, result.output
    shown = [line for line in result.stderr.splitlines() if line.startswith("conversation ")]
    assert len(shown) == 2 and shown[0].startswith("conversation 2 earlier turns (")
    assert shown[1] == "conversation 0 earlier turns (0 tokens; /clear forgets them)"
    assert "a new conversation starts" in result.stderr
    described = json.loads(invoke("info", str(saved), "--json").stdout)
    ready = int(result.stderr.split(" tokens ready")[0].split()[-1])
    assert described["original_length"] == ready  # the document's tokens, no turn in it


@pytest.mark.slow
def test_ask_continue_goes_on_with_the_last_conversation(home, embedded):
    """`ask -c` asks about the last ask's document with its questions and answers before the new one, as the
    library's conversation (Session.with_turn) answers; each -c adds its turn; with nothing to continue, exit 2."""
    from snapkv.io.documents import read_sources
    from snapkv.session import Session
    from snapkv.storage.store import CacheStore
    from snapkv_cli.conversation import last_conversation

    first = invoke("ask", str(SAMPLE), REVENUE, "-q", "--max-new-tokens", "24", "--no-log")
    assert first.exit_code == 0, first.output
    with pytest.raises(ConfigError, match="no conversation to continue"):  # --no-log keeps none
        invoke("ask", "-c", "And the year before?", "-q")
    first = invoke("ask", str(SAMPLE), REVENUE, "-q", "--max-new-tokens", "24")
    follow = invoke("ask", "-c", "And the year before?", "-q", "--max-new-tokens", "24")
    assert follow.exit_code == 0, follow.output
    source, turns = last_conversation()
    assert source == str(SAMPLE.resolve())
    assert [(question, answer.strip()) for question, answer in turns] == [
        (REVENUE, first.stdout.strip()), ("And the year before?", follow.stdout.strip())]
    session = Session(embedded, DEFAULTS, store=CacheStore())
    prepared = session.with_turn(session.prepare(read_sources(str(SAMPLE))), REVENUE, turns[0][1])
    assert follow.stdout.strip() == "".join(session.ask(prepared, "And the year before?", max_new_tokens=24)).strip()
    # the report counts the conversation's turns apart from the document's tokens
    third = json.loads(invoke("ask", "-c", "And the net debt?", "--json", "--max-new-tokens", "8").stdout)
    assert third["conversation"]["turns"] == 2 and third["conversation"]["tokens"] > 0
    assert third["document"]["tokens"] == prepared.tokens - prepared.turn_tokens
