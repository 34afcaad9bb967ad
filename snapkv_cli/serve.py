"""snapkv serve: keep the model loaded between commands, as ollama does, so that a follow-up `snapkv ask`
costs what the REPL pays instead of a process start, imports and a model load; or, with --http, serve the
OpenAI-compatible API (snapkv_cli.serve_http), from replicas on Ray Serve with --ray (snapkv_cli.serve_ray).

`snapkv ask` looks for the server's socket first and, when one answers, runs there: the same code, the same
output on stdout and stderr, the same exit code (snapkv_cli.local_client). When none answers, the first `ask`
starts one in the background (its input checked first, so a mistyped path never waits on a model load) and runs
there; that server stops after SNAPKV_KEEP_ALIVE seconds without a request (300; 0 starts none). The socket lives
in the snapkv home, readable by its user only (and connections from other users are refused); the server
(snapkv_cli.local_server) exits after --idle-timeout seconds without a request, or on `snapkv serve --stop`. The
wire protocol is snapkv_cli.local_protocol's.

The server runs each `ask` in-process through the command runner the app hands every command (typer's context
object: snapkv_cli.app.run), so that no module here imports the app.
"""

import os
import sys
import time
from typing import Optional

import typer

from snapkv.base.ownership import NotPrivate

from . import local_client, local_server
from .local_protocol import socket_path
from .options import TruncateOption

DEFAULT_IDLE_SECONDS = 900
SERVER_STATE_EXIT = 8          # serve --status with none running, or serve with one running (snapkv.base.errors.EXIT_CODES)


def serve(
    context: typer.Context,
    stop: bool = typer.Option(False, "--stop", help="Stop the running server."),
    status: bool = typer.Option(False, "--status", help="Say whether a server is running, and where."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Run in the background (output to serve.log in the "
                                                              "snapkv home)."),
    idle_timeout: float = typer.Option(DEFAULT_IDLE_SECONDS, min=1, help="Exit after this many seconds without a "
                                                                          "request."),
    model: Optional[str] = typer.Option(None, "--model", "-m", envvar="SNAPKV_MODEL",
                                        help="The model to load at start (default: the embedded one)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16."),
    http: Optional[str] = typer.Option(None, "--http", metavar="[HOST:]PORT",
                                       help="Serve the OpenAI-compatible API (/v1/chat/completions, /v1/models, "
                                            "/health) on this port, 127.0.0.1 unless a host is given, instead of "
                                            "the local socket."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SNAPKV_API_KEY",
                                          help="With --http: answer only requests that send Authorization: Bearer "
                                               "KEY (required to listen beyond loopback)."),
    queue: int = typer.Option(8, "--queue", min=0, max=1024,
                              help="With --http: requests that may wait while one is answered; more get 429."),
    cite: bool = typer.Option(False, "--cite", help="With --http: list the passages each answer drew on "
                                                    "(snapkv.citations) unless a request says otherwise."),
    store: Optional[str] = typer.Option(None, "--store", metavar="URL", envvar="SNAPKV_STORE",
                                        help="With --http: the cache store, a folder or an fsspec URL shared by "
                                             "several servers (s3://bucket/prefix needs s3fs)."),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="[ADDRESS]",
                                      help="With --http: run the API as a Ray Serve application, on a Ray started "
                                           "here (no ADDRESS) or on the cluster at ADDRESS (auto, ray://HOST:10001); "
                                           "needs pip install 'snapkv[cluster]'."),
    replicas: str = typer.Option("1", "--replicas", metavar="N|MIN-MAX",
                                 help="With --ray: replicas, each loading the model once; MIN-MAX autoscales."),
    replica_cpus: Optional[float] = typer.Option(None, "--replica-cpus", min=0.01,
                                                 help="With --ray: CPUs each replica reserves (default: this "
                                                      "machine's shared out on a Ray started here, else 1; GPU "
                                                      "replicas 1)."),
    truncate: TruncateOption = None,
) -> None:
    """Keep the model loaded so that `snapkv ask` answers without starting over (a local Unix socket), or, with
    --http, serve it to any OpenAI client, from this process or, with --ray, from replicas on Ray Serve.

    While it runs, `snapkv ask` runs there: same output, exit codes and --json; `ask --no-server` or
    SNAPKV_NO_SERVER=1 runs where it is typed instead. With --http, everything before a request's last user
    message is the document (its compressed cache looked up in the store, made and saved when missing) and that
    message is the question.
    """
    if store and http is None and "SNAPKV_STORE" not in os.environ:
        print("snapkv: error: --store goes with --http (SNAPKV_STORE sets the store of every command)",
              file=sys.stderr)
        raise typer.Exit(2)
    if cite and http is None:
        print("snapkv: error: --cite goes with --http (snapkv ask --cite cites through the local server)",
              file=sys.stderr)
        raise typer.Exit(2)
    if (ray is not None or replicas != "1" or replica_cpus is not None) and http is None:
        print("snapkv: error: --ray, --replicas and --replica-cpus go with --http (snapkv serve --http 8000 --ray)",
              file=sys.stderr)
        raise typer.Exit(2)
    if (replicas != "1" or replica_cpus is not None) and ray is None:
        print("snapkv: error: --replicas and --replica-cpus go with --ray", file=sys.stderr)
        raise typer.Exit(2)
    if http is not None:
        if stop or status or detach:
            print("snapkv: error: --http runs in the foreground; it takes none of --stop, --status, --detach",
                  file=sys.stderr)
            raise typer.Exit(2)
        if ray is not None:
            from .serve_ray import serve_ray

            serve_ray(ray, replicas, replica_cpus, http, api_key, queue, model, device, dtype, truncate, cite, store)
            return
        from .serve_http import serve_http

        serve_http(http, api_key, queue, model, device, dtype, truncate, cite, store)
        return
    path = socket_path()
    if stop:
        print("stopped the snapkv server" if local_client.stop_server() else "no snapkv server is running")
        return
    running = local_client.listening()
    if status:
        print(f"a snapkv server is running on {path}" if running else "no snapkv server is running")
        if running:
            return
        raise typer.Exit(SERVER_STATE_EXIT)
    if running:
        print(f"a snapkv server is already running on {path}; stop it with snapkv serve --stop", file=sys.stderr)
        raise typer.Exit(SERVER_STATE_EXIT)
    if detach and not local_server.detach():
        for _ in range(600):  # the parent waits until the server listens, so that the next ask finds it
            time.sleep(0.1)
            if local_client.listening():
                print(f"snapkv server listening on {path} (idle timeout {idle_timeout:.0f} s); stop it with "
                      "snapkv serve --stop")
                return
        print("snapkv: error: the server did not start; see serve.log in the snapkv home", file=sys.stderr)
        raise typer.Exit(1)
    if not detach:
        print(f"snapkv server: loading the model, then listening on {path} (idle timeout {idle_timeout:.0f} s; "
              "Ctrl-C or snapkv serve --stop to end)", file=sys.stderr)
    try:
        with local_server.one_server_per_home():
            local_server.serve_forever(idle_timeout, model, device, dtype, run_command=context.obj)
    except local_server.AlreadyServing:
        print("snapkv: error: a snapkv server already runs for this home; stop it with snapkv serve --stop",
              file=sys.stderr)
        raise typer.Exit(SERVER_STATE_EXIT) from None
    except NotPrivate as error:
        print(f"snapkv: error: the server's socket folder cannot be trusted: {error}", file=sys.stderr)
        raise typer.Exit(1) from None
