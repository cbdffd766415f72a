"""What completions and chat share: ids, SSE framing, usage, `ResponseRun`, the life of one
response (collect for a JSON body, or stream chunks), parameterized by the endpoint's own
rendering of choices; and what bounds a response from outside: its deadline
(`within_deadline`) and its tenant's prefix-cache salt (`tenant_cache_salt`)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from deployments.engine.client import EngineClient
from deployments.http.choice_streams import ChoiceSpec, ChoiceStreams, EngineStreamResponse, make_choice_specs
from deployments.engine.exceptions import EngineDeadError
from deployments.http.errors import APIError, from_engine_exception
from deployments.engine.outputs import RequestOutput
from deployments.http.protocol import SamplingRequest
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def created_ts() -> int:
    # Wall clock only for the `created` field (METRICS.md: every interval uses the monotonic clock).
    return int(time.time())


def sse_event(payload: dict[str, Any]) -> bytes:
    # orjson: compact UTF-8 in one call, several times faster than json.dumps per chunk.
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def json_response(body: dict[str, Any], background: BackgroundTask | None = None) -> Response:
    return Response(orjson.dumps(body), media_type="application/json", background=background)


@dataclass
class ChoiceProgress:
    """What the response knows about one choice so far (both endpoints)."""

    # The choice it tracks.
    spec: ChoiceSpec
    # Text released so far.
    text_parts: list[str] = field(default_factory=list)
    # Output tokens so far (the engine's count, stop-string truncation applied at the end).
    num_output_tokens: int = 0
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # "stop" | "length" once finished; "abort" when the engine failed this choice alone.
    finish_reason: str | None = None
    # Per-request metrics object (issue 5), when asked for and finished.
    metrics: dict[str, Any] | None = None

    def add(self, out: RequestOutput) -> None:
        if out.new_text:
            self.text_parts.append(out.new_text)
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def make_usage(choices: Sequence[ChoiceProgress]) -> dict[str, Any]:
    """OpenAI usage: each prompt counted once however many choices it has."""
    prompt_tokens = sum(len(c.spec.prompt_token_ids) for c in choices if c.spec.first_of_prompt)
    cached_tokens = sum(c.num_cached_tokens for c in choices if c.spec.first_of_prompt)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# Renders one output of a choice as the body of a chunk's choice, or None when there is nothing to send.
DeltaRenderer = Callable[["ChoiceProgress", RequestOutput], dict[str, Any] | None]
# Renders the closing chunk's choice body of a finished choice (carries finish_reason).
FinishRenderer = Callable[["ChoiceProgress"], dict[str, Any]]


@dataclass
class ResponseRun:
    """One OpenAI response in progress: its choices, their engine requests, what was asked."""

    # The validated request body.
    request: SamplingRequest
    # The engine (for metrics and first-token marks).
    engine: EngineClient
    # Fields every body and chunk starts with: id, object, created, model.
    header: dict[str, Any]
    # The engine requests behind the choices.
    streams: ChoiceStreams
    # What is known of each choice so far, by choice index.
    choices: list[ChoiceProgress]
    # Attach the per-request `metrics` object (server config or the body asked for it).
    want_metrics: bool

    @classmethod
    def create(
        cls,
        engine: EngineClient,
        request: SamplingRequest,
        id_prefix: str,
        object_name: str,
        prompts: Sequence[list[int]],
        params: Sequence[Sequence[SamplingParams]],
        arrival_ts: float,
    ) -> "ResponseRun":
        response_id = random_id(id_prefix)
        specs = make_choice_specs(response_id, prompts, params)
        header = {"id": response_id, "object": object_name, "created": created_ts(), "model": engine.model_name}
        return cls(
            request=request,
            engine=engine,
            header=header,
            streams=ChoiceStreams(engine, specs, arrival_ts),
            choices=[ChoiceProgress(spec) for spec in specs],
            want_metrics=engine.metrics.wants_request_metrics(request.asks_for_metrics),
        )

    def _record(self, index: int, out: RequestOutput) -> ChoiceProgress:
        choice = self.choices[index]
        choice.add(out)
        if out.finished and self.want_metrics:
            choice.metrics = self.engine.metrics.request_metrics(out.request_id)
        return choice

    # ---- a whole JSON body ----------------------------------------------------------------

    async def collect(self, on_output: Callable[[ChoiceProgress, RequestOutput], None]) -> None:
        """Run every choice to its end; `on_output` sees each output (logprobs accumulate there).
        A choice the engine failed alone ends with finish_reason "abort" (logged): its siblings'
        work is in the same body, so the response is not turned into an error."""
        try:
            async for index, out in self.streams.outputs():
                if out.error is not None and getattr(self.engine, "dead_reason", None) is not None:
                    # Not this request's fault: the engine died under it. The client gets the
                    # 503 of a dead engine, not a 200 whose choices were cut off.
                    raise from_engine_exception(EngineDeadError(self.engine.dead_reason))
                on_output(self._record(index, out), out)
        except BaseException:
            self.streams.finish()
            raise

    def whole_response(self, choice_bodies: list[dict[str, Any]]) -> Response:
        for choice, body in zip(self.choices, choice_bodies):
            if choice.num_output_tokens:
                # The body carries every token: the first one is handed over with it.
                self.streams.mark_first_token_sent(choice.spec.index)
            if choice.metrics is not None:
                # Again, now that FIRST_TOKEN_SENT is recorded: TTFT ends there, and e2e_latency
                # ends when these metrics are taken, right after it (the body's own send).
                choice.metrics = self.engine.metrics.request_metrics(choice.spec.request_id) or choice.metrics
                body["metrics"] = choice.metrics
        body = {**self.header, "choices": choice_bodies, "usage": make_usage(self.choices)}
        if self.want_metrics and len(self.choices) == 1:
            body["metrics"] = self.choices[0].metrics
        # A background task runs once the body has been handed over: that is RESPONDED.
        return json_response(body, background=BackgroundTask(self.streams.finish_after_send))

    # ---- server-sent events ---------------------------------------------------------------

    async def stream_response(
        self, render_delta: DeltaRenderer, render_finish: FinishRenderer, opening: list[dict[str, Any]] = ()
    ) -> EngineStreamResponse:
        """Admit every choice first (errors become a status code), then stream."""
        await self.streams.start()
        return EngineStreamResponse(self._events(render_delta, render_finish, list(opening)), self.streams)

    def chunk(self, choice: ChoiceProgress, choice_body: dict[str, Any]) -> dict[str, Any]:
        event = {**self.header, "choices": [choice_body]}
        if self.request.continuous_usage:
            event["usage"] = make_usage([choice])
        elif self.request.include_usage:
            # OpenAI: with include_usage, every chunk but the last has "usage": null.
            event["usage"] = None
        return event

    async def _events(
        self, render_delta: DeltaRenderer, render_finish: FinishRenderer, opening: list[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        try:
            for event in opening:
                yield sse_event(event)
            async for index, out in self.streams.outputs():
                choice = self._record(index, out)
                delta = render_delta(choice, out)
                if delta is not None:
                    yield sse_event(self.chunk(choice, delta))
                    if out.new_token_ids:
                        # We resume here once the chunk has been handed over: the first token is out.
                        self.streams.mark_first_token_sent(index)
                if out.error is not None:
                    # This choice failed alone; headers are gone: the error goes in-band below.
                    raise APIError(500, f"The engine failed the request: {out.error}", code="request_failed")
                if out.finished:
                    final = self.chunk(choice, render_finish(choice))
                    if choice.metrics is not None:
                        final["metrics"] = choice.metrics
                    yield sse_event(final)
            if self.request.include_usage:
                yield sse_event({**self.header, "choices": [], "usage": make_usage(self.choices)})
            yield SSE_DONE
        except APIError as err:
            # Headers are gone already: report the failure in-band, as OpenAI and vLLM do.
            yield sse_event(err.body())
            yield SSE_DONE
        finally:
            self.streams.finish()


# ---- deadlines ------------------------------------------------------------------------------


def request_deadline_s(server_timeout_s: float | None, client_timeout_s: float | None) -> float | None:
    """The request's deadline in seconds: the server's, which the client's can only shorten."""
    given = [t for t in (server_timeout_s, client_timeout_s) if t is not None]
    return min(given) if given else None


def deadline_exceeded(timeout_s: float) -> APIError:
    return APIError(408, f"The request did not finish within its deadline of {timeout_s:g} s and was aborted.",
                    param="request_timeout_s", code="request_timeout")


async def within_deadline(respond: Awaitable[Response], timeout_s: float | None, elapsed_s: float = 0.0) -> Response:
    """`respond`'s response, bounded by `timeout_s` from the request's arrival, `elapsed_s` ago
    (reading and parsing its body). Past the deadline, the work is
    cancelled, which closes its engine requests (their KV freed: ResponseRun.collect /
    ChoiceStreams.start end them on any exit): before a stream's headers the client gets 408;
    in a stream, an in-band 408 error event and `data: [DONE]`."""
    if timeout_s is None:
        return await respond
    deadline = asyncio.get_running_loop().time() + timeout_s - elapsed_s
    scope = asyncio.timeout_at(deadline)
    try:
        async with scope:
            response = await respond
    except TimeoutError:
        if not scope.expired():
            raise  # someone else's timeout, not the deadline
        raise deadline_exceeded(timeout_s) from None
    if isinstance(response, StreamingResponse):
        response.body_iterator = _stream_until(response.body_iterator, deadline, timeout_s)
    return response


async def _stream_until(chunks: AsyncIterator[bytes], deadline: float, timeout_s: float) -> AsyncIterator[bytes]:
    # The timeout covers only the wait for the next chunk, never a `yield`: a cancellation
    # there would land in the server's send, not here.
    iterator = aiter(chunks)
    while True:
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                chunk = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if not scope.expired():
                raise
            # The cancellation went through the stream's generator: its `finally` closed its
            # engine requests. Tell the client in-band (headers are gone).
            logger.info("request aborted at its deadline of %g s", timeout_s)
            yield sse_event(deadline_exceeded(timeout_s).body())
            yield SSE_DONE
            return
        yield chunk


# ---- tenants --------------------------------------------------------------------------------


def _digest(kind: bytes, value: str) -> str:
    # Domain-separated, so a tenant digest can never equal a client-salt digest.
    return hashlib.sha256(b"tpserve-cache-salt/" + kind + b"/" + value.encode("utf-8", "surrogatepass")).hexdigest()


def tenant_cache_salt(tenant: str | None, client_salt: str | None) -> str:
    """The prefix-cache salt of a request when `cache_salt_header` is on: the tenant's (a hash
    of the header's value; "" = no header, all such requests one tenant), combined with the
    client's own `cache_salt` if any. The whole string is built here, so a client's salt can
    split its own tenant's cache further but never name another tenant's. The raw header value
    (an API key, often) is never stored or logged: only its hash reaches the engine."""
    salt = "t:" + _digest(b"tenant", tenant or "")
    if client_salt is not None:
        salt += ":c:" + _digest(b"client", client_salt)
    return salt
