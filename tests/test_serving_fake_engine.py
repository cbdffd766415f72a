"""The HTTP layer over a scripted fake engine: bodies, SSE framing, errors, engine calls.

Fast (no model, no Ray): httpx's ASGI transport drives `make_api` directly, and the official
`openai` client parses what it returns. The same behaviours are checked end to end over Ray
Serve with the real engine in tests/test_http_*.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from deployments.http.api_server import make_api
from deployments.engine.exceptions import EngineDeadError, EngineOverloadedError
from deployments.engine.outputs import PositionLogprobs, RequestOutput, TokenLogprob
from scheduler.admission import AdmissionLimits
from scheduler.sampling_params import SamplingParams


class FakeTokenizer:
    """Words <-> ids: enough for prompts, echo and a chat 'template'."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def __len__(self) -> int:
        return 1000

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(word, len(self.vocab) + 10) for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        words = {v: k for k, v in self.vocab.items()}
        return " ".join(words.get(i, f"<{i}>") for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        if messages[-1]["content"] == "break the template":
            raise ValueError("roles must alternate")
        text = " ".join(f"{m['role']}: {m['content']}" for m in messages)
        return {"input_ids": self.encode(text + (" assistant:" if add_generation_prompt else ""))}


class FakeEngine:
    """Emits tokens ' t0', ' t1', ... (' s{seed}' first when seeded), one output per token."""

    model_name = "fake-model"
    max_model_len = 64
    # What AsyncEngine exposes for the HTTP layer's checks.
    admission_limits = AdmissionLimits(max_model_len)
    vocab_size = 1000

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        # Raised by the next generate() call before it yields (admission errors).
        self.fail_next: BaseException | None = None
        # Raised after the first output of the next request (a failure mid-stream).
        self.fail_midway: BaseException | None = None
        # Every generate() call: (request_id, prompt_token_ids, params).
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        # Request ids handed to release() (AsyncEngine ends those still registered).
        self.released: list[str] = []
        self.first_token_sent: list[str] = []
        self.responded: list[str] = []
        self.healthy = True
        # The HTTP layer reads metrics from `engine.metrics`; this fake plays both.
        self.metrics = self

    async def start(self) -> None: ...

    async def compile_grammar(self, spec) -> None:
        """Every grammar compiles (the real compile bounds: tests/test_grammar_http.py)."""

    async def shutdown(self) -> None: ...

    def is_healthy(self) -> bool:
        return self.healthy

    def render_metrics(self) -> bytes:
        return b"# HELP tpserve_x x\n# TYPE tpserve_x gauge\ntpserve_x{model_name=\"fake-model\"} 1.0\n"

    def get_timeline(self, request_id: str, fmt: str):
        if request_id != "known-0":
            return None
        return {"request_id": request_id, "events": []} if fmt == "json" else "<svg xmlns='http://www.w3.org/2000/svg'/>"

    def wants_request_metrics(self, flag: bool) -> bool:
        return flag

    def request_metrics(self, request_id: str) -> dict:
        return {"queue_time": 0.0, "request_id_seen": request_id}

    def mark_first_token_sent(self, request_id: str) -> None:
        self.first_token_sent.append(request_id)

    def mark_responded(self, request_id: str) -> None:
        self.responded.append(request_id)

    def admit(self, batch, arrival_ts) -> list[AsyncIterator[RequestOutput]]:
        """Like AsyncEngine.admit: admission errors raise for the whole batch before any runs."""
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        return [self.generate(rid, prompt, params, arrival_ts) for rid, prompt, params in batch]

    def release(self, request_ids) -> None:
        self.released.extend(request_ids)

    async def generate(self, request_id, prompt_token_ids, params, arrival_ts) -> AsyncIterator[RequestOutput]:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        self.calls.append((request_id, list(prompt_token_ids), params))
        fail_midway, self.fail_midway = self.fail_midway, None
        finished = False
        try:
            for k in range(params.max_tokens):
                await asyncio.sleep(0)
                text = f" s{params.seed}" if k == 0 and params.seed is not None else f" t{k}"
                logprobs = None
                if params.logprobs is not None:
                    sampled = TokenLogprob(100 + k, text, -0.5)
                    top = [sampled, TokenLogprob(7, " other", -1.5)][: params.logprobs]
                    logprobs = [PositionLogprobs(sampled, top)]
                finished = k == params.max_tokens - 1
                yield RequestOutput(
                    request_id, [100 + k], text, logprobs, finished, "length" if finished else None,
                    len(prompt_token_ids), k + 1, 0,
                )
                if fail_midway is not None:
                    raise fail_midway
        finally:
            if not finished:
                self.aborted.append(request_id)


def run(coro):
    return asyncio.run(coro)


async def post(engine: FakeEngine, path: str, body, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(app=make_api(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://tpserve") as client:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return await client.post(path, content=content, headers={"Content-Type": "application/json"}, **kwargs)


async def get(engine: FakeEngine, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=make_api(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://tpserve") as client:
        return await client.get(path)


def sse_payloads(response: httpx.Response) -> list:
    """The JSON payloads of the SSE events, and a final "[DONE]"; checks the framing."""
    assert response.headers["content-type"].startswith("text/event-stream")
    text = response.text
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    return error


# ---- completions ---------------------------------------------------------------------------


def test_completion_body_and_usage():
    engine = FakeEngine()
    response = run(post(engine, "/v1/completions", {"prompt": "a b c", "max_tokens": 3}))
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": " t0 t1 t2", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    request_id = engine.calls[0][0]
    assert request_id == body["id"] + "-0"
    assert engine.first_token_sent == [request_id] and engine.responded == [request_id]


def test_n_and_multiple_prompts_number_choices_and_offset_seeds():
    engine = FakeEngine()
    body = run(post(engine, "/v1/completions", {"prompt": ["a", "b c"], "n": 2, "seed": 5, "max_tokens": 1})).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [" s5", " s6", " s5", " s6"]
    assert sorted(call[0] for call in engine.calls) == [f"{body['id']}-{i}" for i in range(4)]
    # Each prompt counted once, each choice's tokens counted.
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 4


def test_echo_and_token_id_prompts():
    engine = FakeEngine()
    ids = engine.tokenizer.encode("x y")
    body = run(post(engine, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 1})).json()
    assert body["choices"][0]["text"] == "x y t0"
    assert engine.calls[0][1] == ids


def test_completion_logprobs_format():
    engine = FakeEngine()
    body = run(post(engine, "/v1/completions", {"prompt": "a", "max_tokens": 2, "logprobs": 1})).json()
    assert body["choices"][0]["logprobs"] == {
        "tokens": [" t0", " t1"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{" t0": -0.5}, {" t1": -0.5}],
        "text_offset": [0, 3],
    }


def test_completion_streaming_with_usage():
    engine = FakeEngine()
    body = {"prompt": "a", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_payloads(run(post(engine, "/v1/completions", body)))
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 2
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " t0 t1"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1


def test_continuous_usage_stats():
    engine = FakeEngine()
    body = {"prompt": "a b", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_payloads(run(post(engine, "/v1/completions", body)))
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 2, 2]
    assert all(e["usage"]["prompt_tokens"] == 2 for e in events[:-1])


# ---- chat ----------------------------------------------------------------------------------


def test_chat_body_and_logprobs():
    engine = FakeEngine()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2, "logprobs": True, "top_logprobs": 2}
    result = run(post(engine, "/v1/chat/completions", body)).json()
    assert result["object"] == "chat.completion" and result["id"].startswith("chatcmpl-")
    choice = result["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == " t0 t1"
    assert choice["finish_reason"] == "length"
    first = choice["logprobs"]["content"][0]
    assert first["token"] == " t0" and first["logprob"] == -0.5 and first["bytes"] == list(b" t0")
    assert [t["token"] for t in first["top_logprobs"]] == [" t0", " other"]
    assert engine.calls[0][1] == engine.tokenizer.encode("user: hi assistant:")


def test_chat_default_max_tokens_fills_the_context():
    engine = FakeEngine()
    run(post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}))
    assert engine.calls[0][2].max_tokens == FakeEngine.max_model_len - 3


def test_chat_streaming_role_first_then_content_then_finish():
    engine = FakeEngine()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_payloads(run(post(engine, "/v1/chat/completions", body)))
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine[1:]) == " t0 t1"
        assert mine[-1] == {"index": index, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert events[-2]["usage"]["completion_tokens"] == 4 and events[-2]["choices"] == []


def test_request_metrics_in_body_and_final_chunk():
    engine = FakeEngine()
    body = {"prompt": "a", "max_tokens": 1, "tpserve": {"return_metrics": True}}
    result = run(post(engine, "/v1/completions", body)).json()
    assert result["metrics"]["request_id_seen"] == result["id"] + "-0"
    events = sse_payloads(run(post(engine, "/v1/completions", {**body, "stream": True})))
    assert "metrics" in events[-2] and events[-2]["choices"][0]["finish_reason"] == "length"


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ("{not json", None),
        ("", None),
        ("[1, 2]", None),
        ({"prompt": "a", "temperature": 9}, "temperature"),
        ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_bad_bodies_are_400_never_422(body, param):
    error = assert_error(run(post(FakeEngine(), "/v1/completions", body)), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_prompt_over_the_context_names_both_numbers():
    engine = FakeEngine()
    error = assert_error(run(post(engine, "/v1/completions", {"prompt": "a b c", "max_tokens": 62})), 400)
    assert "3 prompt tokens" in error["message"] and "max_tokens=62" in error["message"]
    assert "max_model_len=64" in error["message"] and error["param"] == "max_tokens"
    assert engine.calls == []


def test_token_ids_outside_the_vocabulary_are_400():
    assert_error(run(post(FakeEngine(), "/v1/completions", {"prompt": [1, 5000]})), 400)


def test_chat_template_failure_is_400():
    body = {"messages": [{"role": "user", "content": "break the template"}]}
    error = assert_error(run(post(FakeEngine(), "/v1/chat/completions", body)), 400)
    assert "roles must alternate" in error["message"]


def test_unknown_model_is_404():
    error = assert_error(run(post(FakeEngine(), "/v1/completions", {"prompt": "a", "model": "gpt-9"})), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"


@pytest.mark.parametrize("stream", [False, True])
def test_overload_is_503_with_retry_after(stream):
    engine = FakeEngine()
    engine.fail_next = EngineOverloadedError("waiting queue full")
    response = run(post(engine, "/v1/completions", {"prompt": "a", "stream": stream}))
    assert_error(response, 503)
    assert int(response.headers["retry-after"]) >= 1
    # The server still serves afterwards.
    assert run(post(engine, "/v1/completions", {"prompt": "a"})).status_code == 200


def test_dead_engine_is_503_and_unknown_errors_are_500_without_trace():
    engine = FakeEngine()
    engine.fail_next = EngineDeadError("worker 1 died")
    # Issue 12 item 8: the reason (which worker, which exception) goes to the log, not to clients.
    dead = assert_error(run(post(engine, "/v1/completions", {"prompt": "a"})), 503)
    assert dead["code"] == "engine_dead" and "worker 1" not in dead["message"]
    engine.fail_next = RuntimeError("secret internals")
    error = assert_error(run(post(engine, "/v1/completions", {"prompt": "a"})), 500)
    assert "secret" not in error["message"]


def test_failure_mid_stream_is_reported_in_band_and_aborts_the_rest():
    engine = FakeEngine()
    engine.fail_midway = RuntimeError("boom")
    events = sse_payloads(run(post(engine, "/v1/completions", {"prompt": "a", "max_tokens": 5, "stream": True})))
    assert events[-2]["error"]["code"] == "internal_error"
    assert engine.aborted == [engine.calls[0][0]]


def test_unknown_route_and_method_are_openai_shaped():
    assert_error(run(get(FakeEngine(), "/v1/nothing")), 404)
    assert_error(run(get(FakeEngine(), "/v1/completions")), 405)


# ---- other routes --------------------------------------------------------------------------


def test_models_health_metrics_timeline():
    engine = FakeEngine()
    models = run(get(engine, "/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    assert run(get(engine, "/health")).status_code == 200
    engine.healthy = False
    assert_error(run(get(engine, "/health")), 503)
    metrics = run(get(engine, "/metrics"))
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert b"tpserve_x" in metrics.content
    assert run(get(engine, "/v1/requests/known/timeline")).json()["request_id"] == "known-0"
    svg = run(get(engine, "/v1/requests/known-0/timeline?format=svg"))
    assert svg.headers["content-type"].startswith("image/svg+xml")
    assert_error(run(get(engine, "/v1/requests/nope/timeline")), 404)
    assert_error(run(get(engine, "/v1/requests/known/timeline?format=png")), 400)


def test_official_openai_client_parses_everything():
    async def scenario():
        engine = FakeEngine()
        http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=make_api(engine)))
        client = openai.AsyncOpenAI(base_url="http://tpserve/v1", api_key="none", http_client=http_client)
        completion = await client.completions.create(model="fake-model", prompt="a", max_tokens=2, logprobs=1)
        assert completion.choices[0].text == " t0 t1" and completion.usage.total_tokens == 3
        chat = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True
        )
        assert chat.choices[0].message.content == " t0 t1"
        assert chat.choices[0].logprobs.content[1].token == " t1"
        stream = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
            stream_options={"include_usage": True},
        )
        pieces = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == " t0 t1"
        assert pieces[-1].usage.completion_tokens == 2
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="a")
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="fake-model", prompt="a", temperature=5)

    run(scenario())


def test_unexpected_exceptions_are_500_without_trace():
    engine = FakeEngine()

    def broken() -> bytes:
        raise RuntimeError("secret internals")

    engine.render_metrics = broken

    async def fetch() -> httpx.Response:
        # Starlette re-raises after sending the 500 (so servers log it); the client sees the body.
        transport = httpx.ASGITransport(app=make_api(engine), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://tpserve") as client:
            return await client.get("/metrics")

    error = assert_error(run(fetch()), 500)
    assert error["type"] == "server_error" and "secret" not in error["message"]
