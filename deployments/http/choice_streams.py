"""One engine request per choice, merged into one stream that always cleans up after itself.

A response with n choices over P prompts runs P x n engine requests, `"{id}-{choice index}"`,
concurrently. `ChoiceStreams` starts them, merges their outputs in arrival order, and guarantees
that whatever happens to the HTTP request (client gone, error, cancellation), every engine
request it started is cancelled, which makes `AsyncEngine.generate()` abort it and free its KV
blocks. Then, and only then, it reports RESPONDED to the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from deployments.http.errors import APIError, from_engine_exception
from deployments.engine.outputs import RequestOutput
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStreamResponse(StreamingResponse):
    """An SSE response that ends its engine requests however the response ends.

    A generator's `finally` only runs if the generator was started and is then closed; a client
    that vanishes before the first chunk, or while the generator sits at a `yield`, would leave
    the engine generating for nobody until garbage collection. This wrapper does not depend on it.
    """

    def __init__(self, content: AsyncIterator[str], streams: "ChoiceStreams") -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._streams.finish()


@dataclass
class ChoiceSpec:
    # Index of the choice in the response (prompt_index * n + i).
    index: int
    # Engine request id: "{response id}-{index}".
    request_id: str
    # Which prompt of the request this choice answers.
    prompt_index: int
    # True for the first choice of its prompt: usage counts each prompt once.
    first_of_prompt: bool
    # The prompt's token ids (shared by the n choices of a prompt).
    prompt_token_ids: list[int]
    # Sampling parameters of this choice (seed + i when seeded).
    params: SamplingParams


def make_choice_specs(
    response_id: str,
    prompts: Sequence[list[int]],
    params_per_prompt: Sequence[Sequence[SamplingParams]],
) -> list[ChoiceSpec]:
    """One spec per (prompt, choice): choice index = prompt_index * n + i, as OpenAI numbers them."""
    specs = []
    for prompt_index, (token_ids, choice_params) in enumerate(zip(prompts, params_per_prompt)):
        for i, params in enumerate(choice_params):
            index = len(specs)
            specs.append(
                ChoiceSpec(index, f"{response_id}-{index}", prompt_index, i == 0, token_ids, params)
            )
    return specs


class ChoiceStreams:
    """Runs one engine request per choice and yields `(choice index, output)` as they come."""

    def __init__(self, engine: Any, specs: Sequence[ChoiceSpec], arrival_ts: float) -> None:
        self._engine = engine
        self._specs = list(specs)
        self._arrival_ts = arrival_ts
        # (choice index, output or None, exception or None); None/None = that stream ended.
        self._queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = (
            asyncio.Queue()
        )
        self._tasks: list[asyncio.Task] = []
        # Items taken from the queue by start() and not yet handed to outputs().
        self._buffered: list[tuple[int, RequestOutput | None, BaseException | None]] = []
        self._first_token_marked: set[int] = set()
        self._responded = False

    async def _pump(self, spec: ChoiceSpec) -> None:
        try:
            async for out in self._engine.generate(
                spec.request_id, spec.prompt_token_ids, spec.params, self._arrival_ts
            ):
                self._queue.put_nowait((spec.index, out, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported to the consumer, which maps it to a response
            self._queue.put_nowait((spec.index, None, exc))
            return
        self._queue.put_nowait((spec.index, None, None))

    def _launch(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._pump(spec)) for spec in self._specs]

    async def start(self) -> None:
        """Submit every choice and wait for each one's first output, so that admission errors
        (too long, overloaded, engine dead) become a status code before a stream begins."""
        self._launch()
        pending = {spec.index for spec in self._specs}
        try:
            while pending:
                item = await self._queue.get()
                index, _, exc = item
                if exc is not None:
                    raise from_engine_exception(exc)
                pending.discard(index)
                self._buffered.append(item)
        except BaseException:
            # No response will carry this request: end the engine side now.
            self.finish()
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every choice, until all have finished; raises APIError on failure."""
        self._launch()
        unfinished = {spec.index for spec in self._specs}
        try:
            while unfinished:
                index, out, exc = (
                    self._buffered.pop(0) if self._buffered else await self._queue.get()
                )
                if exc is not None:
                    raise from_engine_exception(exc)
                if out is None:
                    if index in unfinished:
                        raise from_engine_exception(RuntimeError("engine stream ended early"))
                    continue
                if out.finished:
                    unfinished.discard(index)
                    if out.error is not None:
                        logger.error("engine failed request %s: %s", out.request_id, out.error)
                        raise APIError(500, f"The engine failed the request: {out.error}")
                yield index, out
        finally:
            # Normal end: the pumps are done. Otherwise (client gone, error): abort the rest.
            self.cancel()

    def cancel(self) -> None:
        # Synchronous on purpose: it must work inside an already-cancelled task.
        for task in self._tasks:
            if not task.done():
                task.cancel()

    def mark_first_token_sent(self, index: int) -> None:
        if index not in self._first_token_marked:
            self._first_token_marked.add(index)
            self._engine.mark_first_token_sent(self._specs[index].request_id)

    def finish(self) -> None:
        """The response is over (last byte out, error, or client gone): abort what still runs,
        then, once every engine request has ended, tell the engine the request was responded to
        (RESPONDED closes its records; marking it after the aborts keeps the events in order)."""
        if self._responded:
            return
        self._responded = True
        self.cancel()
        running = [task for task in self._tasks if not task.done()]
        remaining = len(running)

        def on_done(_: asyncio.Task) -> None:
            nonlocal remaining
            remaining -= 1
            if remaining == 0:
                self._mark_responded()

        for task in running:
            task.add_done_callback(on_done)
        if not running:
            self._mark_responded()

    def _mark_responded(self) -> None:
        for spec in self._specs:
            self._engine.mark_responded(spec.request_id)
