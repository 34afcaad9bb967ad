"""snapkv serve --http --ray: the API as Ray Serve replicas (snapkv.serving.ray_app) on a local Ray cluster started
here (2 CPUs, two replicas of the embedded model, a shared temporary folder as the store), driven by the official
`openai` client, and checked against the single-process server's answers."""

import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from snapkv.compression.config import DEFAULTS  # noqa: E402
from snapkv.serving.chat_request import parse_chat_request  # noqa: E402
from snapkv.serving.chat_service import ChatService  # noqa: E402
from snapkv.serving.ray_app import (NAMED_CHARACTERS, REPLICA_HEADER, ReplicaSettings, application,  # noqa: E402
                                   document_name)
from snapkv.storage.store import CacheStore  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "cluster-key-5d1e"
APP = "snapkv-test"
DOCUMENTS = {
    "wick": ("Wick Instruments, annual report. Revenue in 2023 was 121.3 million euros, up from 96.4 million in 2022. "
             "The company employs 412 people at its plant in Tarnow. Its chief executive is Ada Lind, who joined in "
             "2019."),
    "harbor": ("Harbor Mills, company history. The first mill was opened in 1954 in Bergen by Jon Rask. In 2021 the "
               "company had 77 staff and sold 5,300 tonnes of flour. Its oldest customer is the bakery Solbrod."),
    "korvo": ("Korvo Labs was founded in 1999 in Turku. It sells 14 kinds of microscopes, and its sales in 2022 were "
              "8.1 million euros. Its head of research is Mira Aalto."),
    "delta": ("Delta Freight runs 31 barges on the river Oder. Its busiest port is Szczecin, and in 2020 it carried "
              "2.4 million tonnes of coal and grain."),
}
QUESTIONS = {
    "wick": ["What was the revenue in 2023?", "Who is the chief executive?"],
    "harbor": ["Who opened the first mill?", "How many staff did the company have in 2021?"],
    "korvo": ["When was Korvo Labs founded?", "What were the sales in 2022?"],
    "delta": ["How many barges does Delta Freight run?"],
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _messages(name: str, question: str) -> list[dict]:
    return [{"role": "user", "content": DOCUMENTS[name]}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def cluster(embedded_home, tmp_path_factory):
    """The base URL of the application on a Ray started here, with two answerers over one shared folder."""
    from snapkv.engine.models import resolve_model_source

    store = tmp_path_factory.mktemp("cluster-store")
    home = tmp_path_factory.mktemp("cluster-home")
    (home / "models").symlink_to(embedded_home / "models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SNAPKV_HOME", str(home))  # the replicas' home: Ray's workers inherit it
        model = resolve_model_source(None)[1]
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 object_store_memory=80 << 20)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ReplicaSettings(model, "auto", "auto", str(store), KEY, 8, None, False)
        serve.run(application(settings, 2, 1.0, 0.0), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single_process(embedded, tmp_path_factory):
    """What the single-process server (`serve --http`) answers: its ChatService, over a store of its own."""
    service = ChatService(embedded, DEFAULTS, CacheStore(tmp_path_factory.mktemp("single-store")))

    def answer(name: str, question: str) -> tuple[str, int]:
        texts = []
        body = {"model": "snapkv", "messages": _messages(name, question), "max_tokens": 40}
        finished = service.run(parse_chat_request(body), threading.Event(), texts.append)
        return "".join(texts), finished.details["document_tokens"]

    return answer


def _ask(base: str, name: str, question: str, stream: bool = False) -> tuple[str, int, str, dict]:
    """(the answer, its cached tokens, the replica that answered, snapkv's details) through the openai client."""
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=240)
    if stream:
        raw = client.chat.completions.with_raw_response.create(
            model="snapkv", messages=_messages(name, question), max_tokens=40, stream=True,
            stream_options={"include_usage": True})
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        details = next(c.model_extra["snapkv"] for c in chunks if c.choices and c.choices[0].finish_reason)
        return text, chunks[-1].usage.prompt_tokens_details.cached_tokens, raw.headers[REPLICA_HEADER], details
    raw = client.chat.completions.with_raw_response.create(model="snapkv", messages=_messages(name, question),
                                                             max_tokens=40)
    completion = raw.parse()
    return (completion.choices[0].message.content, completion.usage.prompt_tokens_details.cached_tokens,
            raw.headers[REPLICA_HEADER], completion.model_extra["snapkv"])


def test_two_documents_two_questions_each_answer_as_one_process_and_follow_ups_find_their_replica(cluster,
                                                                                                  single_process):
    replicas = {}
    for name in ("wick", "harbor"):
        first, second = QUESTIONS[name]
        text, cached, replica, details = _ask(cluster, name, first)
        expected, tokens = single_process(name, first)
        assert text == expected and text.strip()
        assert cached == 0 and details["cache_source"] == "prefill"  # nobody held it: prefilled
        text, cached, follow_up_replica, details = _ask(cluster, name, second, stream=name == "harbor")
        assert text == single_process(name, second)[0]
        assert cached == tokens > 0  # the document's cache reused
        # routed by the document's name to the replica that made its cache, which still holds it
        assert follow_up_replica == replica and details["cache_source"] == "memory"
        replicas[name] = replica
    # the second document went to the replica holding none: both replicas answer
    assert replicas["wick"] != replicas["harbor"]


def test_a_replica_killed_between_two_questions_loses_no_request(cluster, single_process):
    first, second = QUESTIONS["korvo"]
    text, cached, replica, _ = _ask(cluster, "korvo", first)
    assert text == single_process("korvo", first)[0] and cached == 0
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#Answerer#{replica}", namespace="serve")
    ray.kill(actor, no_restart=True)
    text, cached, other, details = _ask(cluster, "korvo", second)  # at once: the next request is not lost
    expected, tokens = single_process("korvo", second)
    assert other != replica and text == expected
    assert cached == tokens > 0 and details["cache_source"] == "store"  # the other replica read it from the store
    # Serve starts a replica in the dead one's place, and it answers: a new document goes to the replica holding
    # the fewest documents, the new one
    deadline, replaced = time.monotonic() + 180, None
    while replaced is None and time.monotonic() < deadline:
        alive = {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)}
        prefix = f"SERVE_REPLICA::{APP}#Answerer#"
        fresh = {name[len(prefix):] for name in alive if name.startswith(prefix)} - {replica, other}
        if fresh and serve.status().applications[APP].status == "RUNNING":
            replaced = fresh.pop()
        time.sleep(1)
    assert replaced is not None, f"the killed replica was not replaced: {serve.status().applications[APP]}"
    time.sleep(2)  # the router hears of the new replica from Serve's controller (pushed, within milliseconds)
    text, cached, answered_by, details = _ask(cluster, "delta", QUESTIONS["delta"][0])
    assert answered_by == replaced and cached == 0 and text == single_process("delta", QUESTIONS["delta"][0])[0]


def test_a_client_that_closes_its_stream_stops_the_answer_on_its_replica(cluster):
    # an answer that runs to max_tokens on every build (asked to count, the model repeats the document in 70
    # tokens and stops on its own, sooner than a busy machine's Ray carries the cancel)
    messages = _messages("wick", "Write a long essay about the history of Wick Instruments, with many paragraphs.")
    client = openai.OpenAI(base_url=cluster + "/v1", api_key=KEY, max_retries=0, timeout=240)
    raw = client.chat.completions.with_raw_response.create(model="snapkv", messages=messages, max_tokens=1500,
                                                             stream=True)
    stream = raw.parse()
    for count, _ in enumerate(stream, 1):
        if count == 4:  # the role, then three pieces of text
            break
    stream.close()
    replica = raw.headers[REPLICA_HEADER]
    name = document_name(json.dumps({"model": "snapkv", "messages": messages}).encode())
    answerers = serve.get_deployment_handle("Answerer", APP).options(multiplexed_model_id=name)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # asked of the replica holding the document: the one that answered
        stats = answerers.stats.remote().result()
        if stats["replica"] == replica and stats["in_flight"] == 0:
            break
        time.sleep(0.25)
    assert stats["replica"] == replica and stats["in_flight"] == 0, stats
    assert stats["cancelled"] == 1 and 3 <= stats["last_tokens"] < 500, stats  # stopped, not 1500 tokens on


def test_the_router_checks_the_key_and_bounds_the_body_before_any_replica(cluster):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="snapkv", messages=_messages("wick", "Who?"))
    import urllib.error
    import urllib.request

    request = urllib.request.Request(cluster + "/v1/chat/completions", data=b"{}", method="POST", headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "Content-Length": str(64 << 20)})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 413
    request = urllib.request.Request(cluster + "/v1/chat/completions", data=b"{not json", method="POST",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as refused:  # answered by a replica, as one process answers it
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 400 and json.load(refused.value)["error"]["code"] == "invalid_json"
    with urllib.request.urlopen(cluster + "/health", timeout=60) as response:
        assert json.load(response)["status"] == "ok"


def test_a_documents_name_is_its_system_message_and_document_whatever_the_question_or_conversation():
    def body(messages, system=None) -> bytes:
        return json.dumps({"model": "snapkv", "messages": ([{"role": "system", "content": system}] if system else [])
                           + messages}).encode()

    document = {"role": "user", "content": DOCUMENTS["wick"]}
    one = document_name(body([document, {"role": "user", "content": "Who?"}]))
    assert len(one) == 32
    assert document_name(body([document, {"role": "user", "content": "When?"}])) == one
    turn = [document, {"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Ada Lind."},
            {"role": "user", "content": "Since when?"}]
    assert document_name(body(turn)) == one  # a conversation about it goes where its cache is
    assert document_name(body([document, {"role": "user", "content": "Who?"}], system="Be brief.")) != one
    other = {"role": "user", "content": DOCUMENTS["korvo"]}
    assert document_name(body([other, {"role": "user", "content": "Who?"}])) != one
    assert document_name(b"{not json") == document_name(b'{"messages": 3}') == ""
    # a document that grows (or ends otherwise) goes where the cache it shares a prefix with is
    long = " ".join([DOCUMENTS["wick"]] * (NAMED_CHARACTERS // len(DOCUMENTS["wick"]) + 1))
    grown = long + "\n\nAddendum: a later count of staff."
    named = [document_name(body([{"role": "user", "content": text}, {"role": "user", "content": "Who?"}]))
             for text in (long, grown)]
    assert named[0] == named[1] != one


def test_serve_ray_says_what_is_wrong_before_anything_starts(tmp_path, monkeypatch, capsys):
    from snapkv_cli.app import run

    monkeypatch.setenv("SNAPKV_HOME", str(tmp_path))
    for argv, said in ((["serve", "--ray"], "go with --http"),
                       (["serve", "--http", "8000", "--replicas", "2"], "go with --ray"),
                       (["serve", "--http", "8000", "--ray", "--replicas", "3-1"], "MIN-MAX"),
                       (["serve", "--http", "0.0.0.0:8000", "--ray"], "--api-key"),
                       (["serve", "--http", "8000", "--ray", "--store", "nosuchproto://x"], "fsspec")):
        assert run(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, (argv, err)
    from snapkv_cli.serve_ray import parse_replicas, ray_address_optional

    assert parse_replicas("2") == 2 and parse_replicas("1-4") == (1, 4)
    assert ray_address_optional(["serve", "--http", "8000", "--ray"])[-1] == "local"
    assert ray_address_optional(["serve", "--ray", "--http", "8000"])[:3] == ["serve", "--ray", "local"]
    assert ray_address_optional(["serve", "--ray", "auto"]) == ["serve", "--ray", "auto"]


def test_serve_ray_without_ray_says_what_to_install(tmp_path, monkeypatch, capsys):
    import builtins

    from snapkv_cli.app import run

    real_import = builtins.__import__

    def without_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setenv("SNAPKV_HOME", str(tmp_path))
    monkeypatch.setattr(builtins, "__import__", without_ray)
    assert run(["serve", "--http", "8000", "--ray"]) == 2
    assert "pip install 'snapkv[cluster]'" in capsys.readouterr().err


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_snapkv_serve_ray_runs_the_application_on_a_ray_it_starts_and_stops_on_ctrl_c(home, single_process, stop):
    """The command as typed: Ray started here, one replica, an answer equal to one process's; Ctrl-C (SIGINT) or a
    service manager's stop (SIGTERM) ends it all, with no traceback and no C stack frames."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    port = _free_port()
    # as typed in a terminal: Ctrl-C's default action, even where this suite runs with SIGINT ignored (a job a
    # non-interactive shell started in the background: every process it starts inherits that, and Python keeps it)
    server = subprocess.Popen([sys.executable, "-m", "snapkv_cli", "serve", "--http", str(port), "--ray",
                               "--api-key", KEY], stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                              env={**os.environ, "PYTHONFAULTHANDLER": "1"})  # a hang shows its threads (below)
    said, serving = [], threading.Event()

    def drain() -> None:  # read stderr to its end all along: Ray's logs must never fill the pipe and block the server
        for line in server.stderr:
            said.append(line)
            if "serving at" in line:
                serving.set()
        serving.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert serving.wait(timeout=600), "".join(said)
        assert any(f"http://127.0.0.1:{port}/v1 on Ray Serve" in line for line in said), "".join(said)
        text, cached, _, _ = _ask(f"http://127.0.0.1:{port}", "wick", QUESTIONS["wick"][0])
        assert text == single_process("wick", QUESTIONS["wick"][0])[0] and cached == 0
    finally:
        server.send_signal(getattr(signal, stop))
        try:
            code = server.wait(timeout=90)
        except subprocess.TimeoutExpired:  # what it was doing: every thread's stack, then what else ran here
            server.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=20)
            server.kill()
            reader.join(timeout=30)
            busy = subprocess.run(["ps", "-eo", "pid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True,
                                  text=True).stdout.splitlines()[:15]
            raise AssertionError(f"serve --ray did not stop within 90 s of {stop}; it said:\n"
                                 + "".join(said)[-12000:] + "\nbusiest processes:\n" + "\n".join(busy)) from None
    reader.join(timeout=30)
    printed = "".join(said)
    assert code == 0 and "Traceback" not in printed and "Stack trace" not in printed and "SIGABRT" not in printed, printed


class _FlakyAnswerers:
    """A stand-in for the answerers' handle: the first `failures` requests fail as a dead replica's do (or with
    `error`), the next is answered 200 with one body message."""

    def __init__(self, failures: int, error: Exception | None = None) -> None:
        self.failures, self.error, self.sent, self.names = failures, error, 0, []
        self.relay = self

    def options(self, **options):
        self.names.append(options.get("multiplexed_model_id", ""))
        return self

    def remote(self, method, path, headers, body):
        self.sent += 1
        failing = self.sent <= self.failures

        async def messages():
            if failing:
                raise self.error or ray.exceptions.ActorDiedError()
            yield {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            yield {"type": "http.response.body", "body": b'{"ok": true}', "more_body": False}

        return messages()


def _route(answerers, body: bytes = b"{}") -> tuple[int, bytes]:
    import asyncio

    from starlette.requests import Request

    from snapkv.serving.ray_app import Router

    router = Router.func_or_class(answerers, None)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
    delivered = []

    async def receive():
        if delivered:
            return {"type": "http.disconnect"}
        delivered.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    response = asyncio.run(router(Request(scope, receive)))
    return response.status_code, response.body


def test_a_request_whose_replica_dies_before_answering_is_sent_again_and_a_full_queue_is_a_429():
    body = json.dumps({"model": "snapkv", "messages": _messages("wick", "Who?")}).encode()
    answerers = _FlakyAnswerers(failures=2)
    assert _route(answerers, body) == (200, b'{"ok": true}')
    assert answerers.sent == 3 and len(set(answerers.names)) == 1 and answerers.names[0]  # routed by its document
    status, said = _route(_FlakyAnswerers(failures=3), body)  # every try failed: said, not hung
    assert status == 503 and json.loads(said)["error"]["code"] == "unavailable"
    from ray.serve.exceptions import BackPressureError

    status, said = _route(_FlakyAnswerers(failures=1, error=BackPressureError(num_queued_requests=8,
                                                                                max_queued_requests=8)), body)
    assert status == 429 and json.loads(said)["error"]["code"] == "queue_full"


def test_replicas_are_counted_or_autoscaled_take_one_request_each_and_reserve_what_they_are_given():
    settings = ReplicaSettings(None, "auto", "auto", None, None, 8, None, False)
    fixed = application(settings, 3, 2.0, 0.0)._bound_deployment.init_args[0]._bound_deployment
    assert fixed.num_replicas == 3 and fixed.max_ongoing_requests == 1 and fixed.max_queued_requests == 24
    assert fixed.ray_actor_options == {"num_cpus": 2.0, "num_gpus": 0.0}
    scaled = application(settings, (1, 4), 1.0, 1.0)._bound_deployment.init_args[0]._bound_deployment
    bounds = scaled._deployment_config.autoscaling_config  # Deployment shows no public property for it
    assert (bounds.min_replicas, bounds.max_replicas) == (1, 4) and scaled.max_queued_requests == 32
    assert scaled.ray_actor_options["num_gpus"] == 1.0
