"""An ASGI app under a real uvicorn server on a free local port, in a thread of the test process:
for tests that need a real socket (HTTP clients, the bench clients against fake servers, a real
Prometheus scraping a route)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


@contextlib.contextmanager
def serve_asgi(app: Any, *, lifespan: str = "off", start_timeout_s: float = 10.0) -> Iterator[str]:
    """Serve `app` until the block ends; yields the base URL, http://127.0.0.1:<port>."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, held by us until uvicorn takes the socket over
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise AssertionError(f"uvicorn did not start within {start_timeout_s} s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
