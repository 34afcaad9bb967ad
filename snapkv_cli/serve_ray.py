"""snapkv serve --http --ray: the OpenAI-compatible API as a Ray Serve application (snapkv.serving.ray_app) on a
Ray started here or on a running cluster, until Ctrl-C.

What can be checked here is checked before Ray starts: the address, the key, the replica counts, Ray installed, the
store's URL, and, on a Ray started here, the model (converted once where it is a GGUF file, so that the replicas
load it as it is).
"""

import os
import signal
import sys
import time

import typer

from snapkv.base.errors import ConfigError

LOCAL = "local"              # --ray with no address: a Ray started here, on this machine's CPUs (and GPUs)
MAX_REPLICAS = 256


def parse_replicas(text: str) -> int | tuple[int, int]:
    """'2' -> 2 replicas; '1-4' -> autoscaled between 1 and 4. ConfigError otherwise."""
    low, dash, high = text.partition("-")
    try:
        bounds = (int(low), int(high)) if dash else (int(low), int(low))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1] <= MAX_REPLICAS:
        raise ConfigError(f"--replicas takes N or MIN-MAX with 1 <= MIN <= MAX <= {MAX_REPLICAS}, not {text!r}")
    return bounds[0] if not dash else bounds


def ray_address_optional(argv: list[str]) -> list[str]:
    """`serve --http 8000 --ray` (no address: the option's next word is another option, or none) reads as
    `--ray local`, a Ray started here."""
    if not argv or argv[0] != "serve":
        return argv
    cut = argv.index("--") if "--" in argv else len(argv)
    out = list(argv)
    for index in reversed(range(cut)):
        if out[index] == "--ray" and (index + 1 >= cut or out[index + 1].startswith("-")):
            out.insert(index + 1, LOCAL)
    return out


def _replica_resources(ray, device: str, replicas: int | tuple[int, int], cpus: float | None) -> tuple[float, float]:
    """(CPUs, GPUs) each replica reserves: a GPU each where asked for (or, with --device auto, where the cluster has
    GPUs); CPUs as given, else this machine's shared out among the replicas on a Ray started here, else one."""
    total = ray.cluster_resources()
    wants_gpu = device.startswith("cuda") or (device == "auto" and total.get("GPU", 0) > 0)
    most = replicas if isinstance(replicas, int) else replicas[1]
    if cpus is None:
        cpus = 1.0 if wants_gpu else max(1.0, float(int(total.get("CPU", 1) // most)))
    return cpus, 1.0 if wants_gpu else 0.0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def serve_ray(address: str, replicas_text: str, replica_cpus: float | None, http: str, api_key: str | None,
              queue: int, model: str | None, device: str, dtype: str, truncate: str | None, cite: bool,
              store: str | None) -> None:
    """Start (or join) Ray, run the application, wait for Ctrl-C, then take it down."""
    from .consoles import stderr_console
    from .serve_http import api_url, bound_socket, checked_address

    err = stderr_console()
    try:
        host, port = checked_address(http, api_key)
        replicas = parse_replicas(replicas_text)
        try:
            import ray
            from ray import serve  # noqa: F401

            from snapkv.serving import ray_app
        except ImportError as error:
            raise ConfigError(f"snapkv serve --ray needs Ray Serve ({error.name} is missing): "
                              "pip install 'snapkv[cluster]'") from None
        from snapkv.storage.remote import open_store

        open_store(store)  # a URL fsspec cannot open is said before anything starts
        bound_socket(host, port).close()  # a port in use is said now, not by a proxy failing later
        if address == LOCAL:
            from snapkv.engine.models import resolve_model_source

            model = resolve_model_source(model)[1]  # converted once, here, for every replica
    except ConfigError as error:
        err.print(f"snapkv: error: {error}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None

    if address != LOCAL and not (store or os.environ.get("SNAPKV_STORE")):
        err.print("snapkv: note: no --store: each machine keeps caches in its own store; give a URL every machine "
                  "reads (s3://bucket/prefix, a shared folder) so that any replica can answer any follow-up",
                  markup=False, soft_wrap=True)
    err.print(f"snapkv: starting Ray {'here' if address == LOCAL else 'client at ' + address} ...", markup=False)
    import logging

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's INFO lines about its own start
    ray.init(address=None if address == LOCAL else address, include_dashboard=False, logging_level="WARNING")
    # a service manager's stop (SIGTERM, `timeout`) ends it as Ctrl-C does; set after ray.init, whose own handler
    # exits at once and leaves Ray's threads to abort with C stack frames
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cpus, gpus = _replica_resources(ray, device, replicas, replica_cpus)
        settings = ray_app.ReplicaSettings(model, device, dtype, store, api_key, queue, truncate, cite)
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
        err.print(f"snapkv: starting {replicas if isinstance(replicas, int) else '%d-%d' % replicas} replica(s), "
                  f"{cpus:g} CPU(s) and {gpus:g} GPU(s) each; each loads the model ...", markup=False)
        serve.run(ray_app.application(settings, replicas, cpus, gpus), name="snapkv", route_prefix="/")
        print(f"snapkv: serving at {api_url(host, port)} on Ray Serve (OpenAI-compatible; "
              f"{'API key required' if api_key else 'no API key'}; Ctrl-C stops)", file=sys.stderr, flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    except RuntimeError as error:  # a deployment that cannot start: its replicas' errors are above
        err.print(f"snapkv: error: the Ray Serve application did not start: {error}", markup=False, soft_wrap=True)
        raise typer.Exit(1) from None
    finally:
        serve.shutdown()
        ray.shutdown()
