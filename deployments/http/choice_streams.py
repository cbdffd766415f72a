"""One engine request per choice, read as one stream that always cleans up after itself.

A response with n choices over P prompts runs P x n engine requests, `"{id}-{choice index}"`,
concurrently. `ChoiceStreams` starts them and yields their outputs in arrival order. A single
choice (the common case) is read straight from the engine's generator, with no task or queue in
between; several choices each need a task that forwards into one queue, since one consumer
cannot await several generators at once. Whatever happens to the HTTP request (client gone,
error, cancellation), every engine request it started is closed, which makes
the generator from `AsyncEngine.admit()` abort its request and free its KV blocks; then, and only then, the engine's
metrics are told the request was responded to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from deployments.engine.client import EngineClient
from deployments.engine.outputs import RequestOutput
from deployments.http.errors import from_engine_exception
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStreamResponse(StreamingResponse):
    """An SSE response that ends its engine requests however the response ends.

    A generator's `finally` only runs if the generator was started and is then closed; a client
    that vanishes before the first chunk, or while the generator sits at a `yield`, would leave
    the engine generating for nobody until garbage collection. This wrapper does not depend on it.
    """

    def __init__(self, content: AsyncIterator[bytes], streams: "ChoiceStreams") -> None:
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


# (choice index, output or None, exception or None); None/None = that choice's generator ended.
_Item = tuple[int, RequestOutput | None, BaseException | None]


class ChoiceStreams:
    """Runs one engine request per choice and yields `(choice index, output)` as they come."""

    def __init__(self, engine: EngineClient, specs: Sequence[ChoiceSpec], arrival_ts: float) -> None:
        self._engine = engine
        self._specs = list(specs)
        # All choices admitted together or none: a refusal (queue full, engine dead, too long)
        # is a status code for the whole request, raised here before any choice runs.
        try:
            self._generators: list[AsyncGenerator[RequestOutput, None]] = engine.admit(
                [(spec.request_id, spec.prompt_token_ids, spec.params) for spec in self._specs], arrival_ts
            )
        except Exception as exc:
            raise from_engine_exception(exc) from None
        # Several choices only: one forwarding task per choice into one queue.
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        # Items read by start() and not yet handed to outputs().
        self._buffered: list[_Item] = []
        self._first_token_marked: set[int] = set()
        self._closing: list[asyncio.Task] = []
        self._responded = False

    # ---- reading --------------------------------------------------------------------------
    async def _next(self) -> _Item:
        """The next item of any choice: what start() read first, then the engine's."""
        return self._buffered.pop(0) if self._buffered else await self._read()

    async def _read(self) -> _Item:
        if len(self._generators) > 1:
            self._launch()
            return await self._queue.get()
        try:
            return 0, await anext(self._generators[0]), None
        except StopAsyncIteration:
            return 0, None, None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported to the consumer, which maps it to a response
            return 0, None, exc

    async def _forward(self, index: int) -> None:
        try:
            async for out in self._generators[index]:
                self._queue.put_nowait((index, out, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._queue.put_nowait((index, None, exc))
            return
        self._queue.put_nowait((index, None, None))

    def _launch(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._forward(i)) for i in range(len(self._specs))]

    async def start(self) -> None:
        """Submit every choice and wait for each one's first output, so that admission errors
        (too long, overloaded, engine dead) become a status code before a stream begins."""
        pending = {spec.index for spec in self._specs}
        try:
            while pending:
                item = await self._read()
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
        """Every output of every choice, until all have finished; raises APIError on failure.
        A choice the engine failed alone arrives as a finished output with `error` set."""
        unfinished = {spec.index for spec in self._specs}
        while unfinished:
            index, out, exc = await self._next()
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
            yield index, out

    # ---- ending ---------------------------------------------------------------------------
    def mark_first_token_sent(self, index: int) -> None:
        if index not in self._first_token_marked:
            self._first_token_marked.add(index)
            self._engine.metrics.mark_first_token_sent(self._specs[index].request_id)

    def finish(self) -> None:
        """The response is over (last byte out, error, or client gone): close what still runs,
        then, once every engine request has ended, tell the engine's metrics the request was
        responded to (RESPONDED closes its records; after the aborts keeps events in order).

        Synchronous on purpose: it must work inside an already-cancelled task."""
        if self._responded:
            return
        self._responded = True
        for task in self._tasks:
            task.cancel()
        running = [task for task in self._tasks if not task.done()]
        if not self._tasks:
            # Direct reading: close the generator (its `finally` aborts an unfinished request).
            running += [asyncio.ensure_future(gen.aclose()) for gen in self._generators
                        if gen.ag_frame is not None and not gen.ag_running]
        remaining = len(running)

        def on_done(_: asyncio.Future) -> None:
            nonlocal remaining
            remaining -= 1
            if remaining == 0:
                self._mark_responded()

        for task in running:
            task.add_done_callback(on_done)
        # Choices whose outputs were never read (a task cancelled before it ran never closes
        # its generator): the engine ends them, or they would run on for nobody.
        self._engine.release([spec.request_id for spec in self._specs])
        if not running:
            self._mark_responded()

    async def finish_after_send(self) -> None:
        """`finish` as a response's background task (which runs a plain function on a thread)."""
        self.finish()

    def _mark_responded(self) -> None:
        for spec in self._specs:
            self._engine.metrics.mark_responded(spec.request_id)
