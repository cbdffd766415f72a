"""The real HTTP app over a real in-process engine, driven from synchronous tests.

The app and its engine loop live on an event loop in a background thread (as in a replica);
tests submit requests to it and get plain results back. The app's lifespan runs, so the engine
loop, the tokenizer pool and the health monitor are the production ones.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import httpx

from deployments.config import TpserveConfig
from deployments.engine.async_engine import AsyncEngine
from deployments.http.api_server import make_api


@dataclass
class Reply:
    # HTTP status code.
    status: int
    # Response headers (lower-case names).
    headers: dict[str, str]
    # The whole body as text (SSE included).
    text: str


class LiveApp:
    """make_api(AsyncEngine(config)) on its own event loop thread."""

    def __init__(self, config: TpserveConfig) -> None:
        self.engine = AsyncEngine(config)
        self.app = make_api(self.engine)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="live-app-loop", daemon=True)
        self._thread.start()
        self._lifespan = self.app.router.lifespan_context(self.app)
        self.call(self._lifespan.__aenter__())
        transport = httpx.ASGITransport(app=self.app)
        self._client = httpx.AsyncClient(transport=transport, base_url="http://tpserve", timeout=120)

    def call(self, coro: Any, timeout_s: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def post(self, path: str, content: bytes) -> Reply:
        async def send() -> Reply:
            response = await self._client.post(path, content=content, headers={"Content-Type": "application/json"})
            return Reply(response.status_code, dict(response.headers), response.text)

        return self.call(send())

    def get(self, path: str) -> Reply:
        async def send() -> Reply:
            response = await self._client.get(path)
            return Reply(response.status_code, dict(response.headers), response.text)

        return self.call(send())

    def engine_counts(self) -> tuple[int, int]:
        """(unfinished requests, used KV blocks), read on the engine's own loop."""

        async def read() -> tuple[int, int]:
            return self.engine.num_unfinished_requests, self.engine.num_used_kv_blocks

        return self.call(read())

    def close(self) -> None:
        try:
            self.call(self._client.aclose())
            self.call(self._lifespan.__aexit__(None, None, None))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
