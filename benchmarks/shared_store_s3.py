"""The shared store on S3's protocol: two "machines" (two local stores) share s3://snapkv-shared/caches; the first
prefills and publishes (one put under the final name: S3 has no rename), the second fetches the cache whole and hits,
a second writer of the same document does not write again, both answer alike, and removing it removes the object.

Not a CI check (it needs s3fs and an S3 endpoint). With moto's S3 server standing in for S3:

    pip install s3fs "moto[server]"            # s3fs beside snapkv; moto anywhere
    moto_server -p 5555 &
    FSSPEC_S3_ENDPOINT_URL=http://127.0.0.1:5555 AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test \
        AWS_DEFAULT_REGION=us-east-1 .venv/bin/python benchmarks/shared_store_s3.py
"""
import os, tempfile, time
from pathlib import Path
import s3fs
from snapkv.compression.config import DEFAULTS
from snapkv.engine.models import load_model
from snapkv.io.documents import read_sources
from snapkv.session import Session
from snapkv.storage.remote import open_store

fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["FSSPEC_S3_ENDPOINT_URL"]})
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
