"""Ray Serve replicas over a store on S3's protocol: a follow-up answered by another replica fetches the cache from S3.

Ray started here, two replicas over s3://snapkv-shared/cluster. The first question about the sample report is
prefilled by one replica, which publishes the cache to S3. The cache is then deleted from this machine's local copy
of the store (the replicas share one machine here, so without that the other would find the file on disk), and the
replica that answered is killed. The next question goes to the other replica, which must fetch the cache from S3.
Prints each answer, its replica, its cached tokens and where its cache came from.

Not a CI check (it needs s3fs and an S3 endpoint). With moto's S3 server standing in for S3:

    pip install s3fs "moto[server]"            # s3fs beside snapkv; moto anywhere
    moto_server -p 5555 &
    FSSPEC_S3_ENDPOINT_URL=http://127.0.0.1:5555 AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test \
        AWS_DEFAULT_REGION=us-east-1 .venv/bin/python benchmarks/cluster_s3.py
"""

import socket
import time
from pathlib import Path

import openai
import ray
import s3fs
from ray import serve

from snapkv.engine.models import resolve_model_source
from snapkv.serving.ray_app import REPLICA_HEADER, ReplicaSettings, application
from snapkv.storage.store import CacheStore

URL = "s3://snapkv-shared/cluster"
DOCUMENT = Path("samples/annual_report.txt").read_text()


def ask(client: openai.OpenAI, question: str) -> str:
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model="snapkv", messages=[{"role": "user", "content": DOCUMENT}, {"role": "user", "content": question}],
        max_tokens=32)
    reply = raw.parse()
    print(f"{time.perf_counter() - started:.2f} s  replica {raw.headers[REPLICA_HEADER]}  cached "
          f"{reply.usage.prompt_tokens_details.cached_tokens}  cache from {reply.model_extra['snapkv']['cache_source']}"
          f"  {reply.choices[0].message.content!r}")
    return raw.headers[REPLICA_HEADER]


def main() -> None:
    s3 = s3fs.S3FileSystem()  # FSSPEC_S3_ENDPOINT_URL, as the replicas read it
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
        first = ask(client, "What was the 2023 revenue?")
        print("in S3:", [(path.rsplit("/", 1)[-1], s3.size(path)) for path in s3.ls(URL)])
        for path in local.glob("*.snapkv"):
            path.unlink()  # this machine's copy gone: the other replica must fetch the cache from S3
        ray.kill(ray.get_actor(f"SERVE_REPLICA::s3#Answerer#{first}", namespace="serve"), no_restart=True)
        second = ask(client, "What is the net debt?")
        print("answered by another replica:", second != first, "; fetched back into the local store:",
              [path.name for path in local.glob("*.snapkv")], "; objects in S3:", len(s3.ls(URL)))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
