"""snapkv serve --http: the OpenAI-compatible API (snapkv.serving) on a TCP port, run by uvicorn.

The address is checked and bound before the model loads, so that a port in use or a missing API key is said at
once; anything but loopback needs an API key.
"""

import ipaddress
import socket
import sys

import typer

from snapkv.base.errors import ConfigError

LOOPBACK_NAMES = ("localhost",)
DEFAULT_HOST = "127.0.0.1"


def parse_address(address: str) -> tuple[str, int]:
    """'8000' -> ('127.0.0.1', 8000); 'HOST:PORT' and '[IPv6]:PORT' as written. ConfigError otherwise."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--http takes [HOST:]PORT with a port from 1 to 65535, not {address!r}")
    return host or DEFAULT_HOST, int(port)


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: only this machine's own counts, and only as written above
        return False


def checked_address(address: str, api_key: str | None) -> tuple[str, int]:
    """(host, port) of an --http address; ConfigError for a bad one, or for one beyond loopback without a key."""
    host, port = parse_address(address)
    if not is_loopback(host) and not api_key:
        raise ConfigError(f"--http {address} listens beyond this machine: give --api-key KEY (or set "
                          "SNAPKV_API_KEY) so that only clients that send the key are answered")
    return host, port


def api_url(host: str, port: int) -> str:
    """The API's base URL as a client writes it."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; ConfigError where it cannot be had (in use, no such address)."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(64)
    except OSError as error:
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    listener.setblocking(False)
    return listener


def serve_http(address: str, api_key: str | None, queue: int, model: str | None, device: str, dtype: str,
               truncate: str | None, cite: bool = False, store: str | None = None) -> None:
    """Load the model and answer the API on `address` until Ctrl-C."""
    from .consoles import stderr_console

    err = stderr_console()
    try:
        host, port = checked_address(address, api_key)
        from snapkv.storage.remote import open_store

        shared = open_store(store)  # a URL fsspec cannot open is said before the model loads
        try:
            import uvicorn  # noqa: F401  (checked before the model loads)

            from snapkv.serving.openai_app import OpenAIApp, server_config
        except ImportError as error:
            raise ConfigError(f"snapkv serve --http needs {error.name}: pip install starlette uvicorn") from None
        listener = bound_socket(host, port)
    except ConfigError as error:
        err.print(f"snapkv: error: {error}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None

    from snapkv.compression.config import DEFAULTS
    from snapkv.serving.chat_service import ChatService
    from .render import load_with_status

    loaded, _ = load_with_status(err, model, device, dtype)
    app = OpenAIApp(ChatService(loaded, DEFAULTS, shared, truncate=truncate, cite=cite), api_key=api_key, queue=queue)
    print(f"snapkv: serving {loaded.name} at {api_url(host, port)} (OpenAI-compatible; "
          f"{'API key required' if api_key else 'no API key'}; Ctrl-C stops)", file=sys.stderr, flush=True)
    uvicorn.Server(server_config(app.asgi)).run(sockets=[listener])
