"""`snapkv serve --http --ray` and the shared store, measured: throughput, and S3's protocol.

One script, one subcommand per study (each says what it measures with --help):

    load       throughput of serve --ray: 1 replica against 2, and 2 not routed by document
    s3         replicas over S3's protocol: a follow-up on another replica fetches the cache from S3
    store-s3   two machines sharing a store on S3's protocol

    .venv/bin/python benchmarks/cluster.py SUBCOMMAND [OPTIONS]
"""

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import openai
import ray
from ray import serve

from snapkv.compression.config import DEFAULTS
from snapkv.engine.models import load_model, resolve_model_source
from snapkv.io.documents import read_sources
from snapkv.measure.studies import run_study
from snapkv.serving.ray_app import REPLICA_HEADER, ReplicaSettings, application
from snapkv.session import Session
from snapkv.storage.remote import open_store
from snapkv.storage.store import CacheStore

LOAD_DOC = """Throughput of `snapkv serve --http --ray` on this machine: 1 replica against 2, and 2 without routing by document.

Starts Ray here (every CPU of this machine), then for each layout runs the Ray Serve application of
snapkv.serving.ray_app over a fresh store folder and sends it one bounded workload with the official `openai` client:
--clients threads at once, each with its share of --documents fidelity documents (the shortest ones), asking the
first question of each of its documents, then the second of each, and so on (--questions per document; a follow-up
thus comes after other documents were asked about). Reports, per layout: requests/s, p50/p95 latency of every
request and of follow-ups alone, and where each follow-up's cache came from: "held" (the replica that answered had it
in memory: the cache-hit rate routing is for), "store" (read from the shared folder), "prefill".

    .venv/bin/python benchmarks/cluster.py load
    .venv/bin/python benchmarks/cluster.py load --documents 8 --questions 3 --clients 4 --layouts 1,2,2-unrouted
"""


def workload(documents: int, questions: int) -> list[tuple[str, str, list[str]]]:
    """(name, text, questions) of the `documents` shortest fidelity documents that have `questions` questions."""
    folder = resources.files("snapkv.io") / "data" / "fidelity"
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".json"):
            asked = [q["question"] for q in json.loads(entry.read_text())["questions"]][:questions]
            text = (folder / entry.name.replace(".json", ".txt")).read_text()
            if len(asked) == questions:
                found.append((entry.name[:-5], text, asked))
    return sorted(found, key=lambda item: len(item[1]))[:documents]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ask(client: openai.OpenAI, text: str, question: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model="snapkv", messages=[{"role": "user", "content": text}, {"role": "user", "content": question}],
        max_tokens=max_tokens)
    completion = raw.parse()
    return {"seconds": time.perf_counter() - started, "replica": raw.headers[REPLICA_HEADER],
            "source": completion.model_extra["snapkv"]["cache_source"],
            "cached": completion.usage.prompt_tokens_details.cached_tokens}


def run_layout(base: str, documents: list, clients: int, max_tokens: int) -> tuple[float, list[dict]]:
    """(wall seconds, one record per request) for the workload sent by `clients` threads at once."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=1800)
    shares = [documents[i::clients] for i in range(clients)]
    records, lock = [], threading.Lock()

    def one_client(share: list) -> None:
        for round_ in range(len(share[0][2]) if share else 0):
            for name, text, asked in share:
                record = ask(client, text, asked[round_], max_tokens)
                record.update(document=name, follow_up=round_ > 0)
                with lock:
                    records.append(record)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for done in [pool.submit(one_client, share) for share in shares]:
            done.result()
    return time.perf_counter() - started, records


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def summary(layout: str, replicas: int, cpus: float, wall: float, records: list[dict]) -> dict:
    follow_ups = [r for r in records if r["follow_up"]]
    every = [r["seconds"] for r in records]
    later = [r["seconds"] for r in follow_ups]
    share = {source: sum(r["source"] == source for r in follow_ups) / max(1, len(follow_ups))
             for source in ("memory", "store", "prefill")}
    return {"layout": layout, "replicas": replicas, "cpus_per_replica": cpus, "requests": len(records),
            "wall_seconds": round(wall, 1), "requests_per_second": round(len(records) / wall, 3),
            "p50_seconds": round(statistics.median(every), 2), "p95_seconds": round(percentile(every, 0.95), 2),
            "follow_up_p50_seconds": round(statistics.median(later), 2),
            "follow_up_p95_seconds": round(percentile(later, 0.95), 2),
            "follow_up_held": round(share["memory"], 3), "follow_up_from_store": round(share["store"], 3),
            "follow_up_prefilled": round(share["prefill"], 3),
            "replicas_answering": len({r["replica"] for r in records})}


def run_load(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=LOAD_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--layouts", default="1,2,2-unrouted", help="replica counts; -unrouted: no routing by document")
    args = parser.parse_args(argv)

    documents = workload(args.documents, args.questions)
    model = resolve_model_source(None)[1]
    cpus = os.cpu_count() or 1
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             object_store_memory=80 << 20)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    try:
        for layout in args.layouts.split(","):
            replicas = int(layout.split("-")[0])
            per_replica = max(1.0, float(cpus // replicas))
            with tempfile.TemporaryDirectory(prefix="snapkv-cluster-store-") as store:
                settings = ReplicaSettings(model, "auto", "auto", store, None, 8, None, False)
                serve.run(application(settings, replicas, per_replica, 0.0, route_by_document="unrouted" not in layout),
                          name="load", route_prefix="/")
                wall, records = run_layout(f"http://127.0.0.1:{port}", documents, args.clients, args.max_tokens)
                serve.delete("load")
            rows.append(summary(layout, replicas, per_replica, wall, records))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"\n{len(documents)} documents x {args.questions} questions, {args.clients} clients at once, "
          f"{args.max_tokens} tokens per answer, {cpus} CPUs\n")
    print("| layout | CPUs/replica | req/s | p50 s | p95 s | follow-up p50 s | follow-up p95 s | follow-ups held "
          "| from store | prefilled |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['layout']} | {row['cpus_per_replica']:g} | {row['requests_per_second']:.3f} | "
              f"{row['p50_seconds']} | {row['p95_seconds']} | {row['follow_up_p50_seconds']} | "
              f"{row['follow_up_p95_seconds']} | {row['follow_up_held']:.0%} | {row['follow_up_from_store']:.0%} | "
              f"{row['follow_up_prefilled']:.0%} |")


S3_DOC = """Ray Serve replicas over a store on S3's protocol: a follow-up answered by another replica fetches the cache from S3.

Ray started here, two replicas over s3://snapkv-shared/cluster. The first question about the sample report is
prefilled by one replica, which publishes the cache to S3. The cache is then deleted from this machine's local copy
of the store (the replicas share one machine here, so without that the other would find the file on disk), and the
replica that answered is killed. The next question goes to the other replica, which must fetch the cache from S3.
Prints each answer, its replica, its cached tokens and where its cache came from.

Not a CI check (it needs s3fs and an S3 endpoint). With moto's S3 server standing in for S3:

    pip install s3fs "moto[server]"            # s3fs beside snapkv; moto anywhere
    moto_server -p 5555 &
    FSSPEC_S3_ENDPOINT_URL=http://127.0.0.1:5555 AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test \
        AWS_DEFAULT_REGION=us-east-1 .venv/bin/python benchmarks/cluster.py s3
"""


URL = "s3://snapkv-shared/cluster"
DOCUMENT = Path("samples/annual_report.txt").read_text()


def s3_ask(client: openai.OpenAI, question: str) -> str:
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model="snapkv", messages=[{"role": "user", "content": DOCUMENT}, {"role": "user", "content": question}],
        max_tokens=32)
    reply = raw.parse()
    print(f"{time.perf_counter() - started:.2f} s  replica {raw.headers[REPLICA_HEADER]}  cached "
          f"{reply.usage.prompt_tokens_details.cached_tokens}  cache from {reply.model_extra['snapkv']['cache_source']}"
          f"  {reply.choices[0].message.content!r}")
    return raw.headers[REPLICA_HEADER]


def s3_filesystem(doc: str, argv: list[str], **options):
    """The S3 studies' start: their --help, then s3fs's filesystem at FSSPEC_S3_ENDPOINT_URL, or a clear exit where
    s3fs or the endpoint is missing."""
    argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    try:
        import s3fs  # only the S3 studies need it
    except ImportError:
        raise SystemExit("this study needs s3fs beside snapkv: pip install s3fs (see --help)") from None
    if not os.environ.get("FSSPEC_S3_ENDPOINT_URL"):
        raise SystemExit("set FSSPEC_S3_ENDPOINT_URL to the S3 endpoint (see --help)")
    return s3fs.S3FileSystem(**options)


def run_s3(argv: list[str]) -> None:
    s3 = s3_filesystem(S3_DOC, argv)  # FSSPEC_S3_ENDPOINT_URL, as the replicas read it
    if not s3.exists("snapkv-shared"):
        s3.mkdir("snapkv-shared")
    local = CacheStore().root  # this machine's store, which the replicas share here
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             object_store_memory=80 << 20)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ReplicaSettings(resolve_model_source(None)[1], "auto", "auto", URL, None, 8, None, False)
        serve.run(application(settings, 2, 1.0, 0.0), name="s3", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        first = s3_ask(client, "What was the 2023 revenue?")
        print("in S3:", [(path.rsplit("/", 1)[-1], s3.size(path)) for path in s3.ls(URL)])
        for path in local.glob("*.snapkv"):
            path.unlink()  # this machine's copy gone: the other replica must fetch the cache from S3
        ray.kill(ray.get_actor(f"SERVE_REPLICA::s3#Answerer#{first}", namespace="serve"), no_restart=True)
        second = s3_ask(client, "What is the net debt?")
        print("answered by another replica:", second != first, "; fetched back into the local store:",
              [path.name for path in local.glob("*.snapkv")], "; objects in S3:", len(s3.ls(URL)))
    finally:
        serve.shutdown()
        ray.shutdown()


STORE_S3_DOC = """The shared store on S3's protocol: two "machines" (two local stores) share s3://snapkv-shared/caches; the first
prefills and publishes (one put under the final name: S3 has no rename), the second fetches the cache whole and hits,
a second writer of the same document does not write again, both answer alike, and removing it removes the object.

Not a CI check (it needs s3fs and an S3 endpoint). With moto's S3 server standing in for S3:

    pip install s3fs "moto[server]"            # s3fs beside snapkv; moto anywhere
    moto_server -p 5555 &
    FSSPEC_S3_ENDPOINT_URL=http://127.0.0.1:5555 AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test \
        AWS_DEFAULT_REGION=us-east-1 .venv/bin/python benchmarks/cluster.py store-s3
"""


def run_store_s3(argv: list[str]) -> None:
    """The shared store on S3's protocol (STORE_S3_DOC)."""
    fs = s3_filesystem(STORE_S3_DOC, argv, client_kwargs={"endpoint_url": os.environ.get("FSSPEC_S3_ENDPOINT_URL")})
    if not fs.exists("snapkv-shared"):
        fs.mkdir("snapkv-shared")
    url = "s3://snapkv-shared/caches"
    loaded = load_model()
    doc = read_sources("samples/annual_report.txt")
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as two:
        os.environ["SNAPKV_STORE"] = url
        a = open_store(); a.root = Path(one)
        print("renames:", a.renames, "protocol:", a.fs.protocol)
        t = time.perf_counter(); first = Session(loaded, DEFAULTS, store=a).prepare(doc); t1 = time.perf_counter() - t
        [entry] = a.entries()
        print("machine one: hit", first.hit, f"{t1:.2f} s; in the store:", entry.key, entry.size, "bytes; partial objects:",
              [n for n in a.fs.ls(a.remote_root) if "partial" in n])
        b = open_store(); b.root = Path(two)
        t = time.perf_counter(); second = Session(loaded, DEFAULTS, store=b).prepare(doc); t2 = time.perf_counter() - t
        print("machine two: hit", second.hit, f"{t2:.2f} s (fetched whole, then loaded)")
        print("second writer publishes again:", b.publish(entry.key), "; bytes equal:",
              a.fs.cat_file(a.remote_path(entry.key)) == (Path(two) / f"{entry.key}.snapkv").read_bytes())
        s = Session(loaded, DEFAULTS)
        ans1 = "".join(s.ask(first, "What was the 2023 revenue?", max_new_tokens=24))
        ans2 = "".join(s.ask(second, "What was the 2023 revenue?", max_new_tokens=24))
        print("same answer:", ans1 == ans2, repr(ans2))
        print("rm:", b.remove(entry.key), "left:", a.entries())


STUDIES = {"load": run_load, "s3": run_s3, "store-s3": run_store_s3}


if __name__ == "__main__":
    run_study(STUDIES, __doc__)
