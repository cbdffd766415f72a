"""The replica's health, checked in the background so /health never waits on the engine.

`engine.is_healthy()` pings the tensor-parallel workers through Ray (up to seconds when one is
slow); run on the event loop it stalled every stream of the replica. `HealthMonitor` calls it on a
thread every `interval_s` and keeps the answer; /health and Serve's check_health read that answer.
A check that does not return within `timeout_s`, or an answer older than a few intervals (the
monitor itself stuck), reads as unhealthy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from deployments.engine.client import EngineClient

logger = logging.getLogger(__name__)

# An answer older than this many intervals no longer counts as healthy.
_STALE_AFTER_INTERVALS = 5


class HealthMonitor:
    """Pings the engine on a thread every `interval_s`; `healthy` is the last answer."""

    def __init__(self, engine: EngineClient, interval_s: float, timeout_s: float | None = None) -> None:
        self._engine = engine
        # Seconds between pings.
        self.interval_s = interval_s
        # A ping that takes longer than this counts as a failure.
        self.timeout_s = timeout_s if timeout_s is not None else max(5.0, 2 * interval_s)
        self._healthy = True
        self._checked_at = time.monotonic()
        self._task: asyncio.Task | None = None
        # One thread: a hung ping keeps it busy, and the next check reports that instead of
        # piling up more threads behind it.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tpserve-health")
        self._inflight: asyncio.Future | None = None

    @property
    def healthy(self) -> bool:
        """The last answer, unless it is stale. Never blocks."""
        if self._task is None:
            # Not started (tests driving the app without its lifespan): ask the engine directly.
            return bool(self._engine.is_healthy())
        stale = time.monotonic() - self._checked_at > _STALE_AFTER_INTERVALS * max(self.interval_s, self.timeout_s)
        # A loop that already stopped is unhealthy now, not at the next ping.
        dead = getattr(self._engine, "dead_reason", None) is not None
        return self._healthy and not stale and not dead

    async def check_once(self) -> bool:
        """Ask the engine on a thread; a timeout or an exception is unhealthy."""
        if self._inflight is None or self._inflight.done():
            loop = asyncio.get_running_loop()
            self._inflight = loop.run_in_executor(self._thread, self._engine.is_healthy)
        try:
            ok = await asyncio.wait_for(asyncio.shield(self._inflight), self.timeout_s)
        except Exception:  # noqa: BLE001 - any failure of the check itself means unhealthy
            # The trace once, when it starts failing; not again every interval.
            logger.warning("engine health check failed", exc_info=self._healthy)
            ok = False
        if self._healthy and not ok:
            logger.error("the engine is unhealthy")
        self._healthy = bool(ok)
        self._checked_at = time.monotonic()
        return self._healthy

    async def _run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._checked_at = time.monotonic()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
        self._thread.shutdown(wait=False, cancel_futures=True)
