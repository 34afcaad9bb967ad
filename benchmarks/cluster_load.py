"""Throughput of `snapkv serve --http --ray` on this machine: 1 replica against 2, and 2 without routing by document.

Starts Ray here (every CPU of this machine), then for each layout runs the Ray Serve application of
snapkv.serving.ray_app over a fresh store folder and sends it one bounded workload with the official `openai` client:
--clients threads at once, each with its share of --documents fidelity documents (the shortest ones), asking the
first question of each of its documents, then the second of each, and so on (--questions per document; a follow-up
thus comes after other documents were asked about). Reports, per layout: requests/s, p50/p95 latency of every
request and of follow-ups alone, and where each follow-up's cache came from: "held" (the replica that answered had it
in memory: the cache-hit rate routing is for), "store" (read from the shared folder), "prefill".

    .venv/bin/python benchmarks/cluster_load.py
    .venv/bin/python benchmarks/cluster_load.py --documents 8 --questions 3 --clients 4 --layouts 1,2,2-unrouted
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

import openai
import ray
from ray import serve

from snapkv.engine.models import resolve_model_source
from snapkv.serving.ray_app import REPLICA_HEADER, ReplicaSettings, application


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--layouts", default="1,2,2-unrouted", help="replica counts; -unrouted: no routing by document")
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
