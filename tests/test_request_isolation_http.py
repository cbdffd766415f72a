"""How the HTTP layer reports a choice the engine failed alone (issue 12, item 2): a JSON body is
still a 200, with finish_reason "abort" on that choice and its siblings intact; a stream carries
the error in-band (its headers are gone)."""

from __future__ import annotations

import asyncio

from deployments.engine.outputs import RequestOutput
from test_serving_fake_engine import FakeEngine, post, run, sse_payloads


class OneChoiceFails(FakeEngine):
    """Choice 1 of every response fails after its first token (as a sampler fault would)."""

    async def generate(self, request_id, prompt_token_ids, params, arrival_ts):
        if not request_id.endswith("-1"):
            async for out in super().generate(request_id, prompt_token_ids, params, arrival_ts):
                yield out
            return
        self.calls.append((request_id, list(prompt_token_ids), params))
        await asyncio.sleep(0)
        yield RequestOutput(request_id, [100], " t0", None, False, None, len(prompt_token_ids), 1, 0)
        yield RequestOutput(request_id, [], "", None, True, "abort", len(prompt_token_ids), 1, 0,
                            error="sampling failed: the logits of this request are not finite")


def test_a_json_body_keeps_its_healthy_choices_and_marks_the_failed_one_abort():
    engine = OneChoiceFails()
    response = run(post(engine, "/v1/completions", {"prompt": "a b", "max_tokens": 3, "n": 2}))
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert choices[0] == {"index": 0, "text": " t0 t1 t2", "logprobs": None, "finish_reason": "length"}
    assert choices[1]["finish_reason"] == "abort" and choices[1]["text"] == " t0"
    assert response.json()["usage"]["completion_tokens"] == 4
    assert sorted(engine.responded) == sorted(call[0] for call in engine.calls)


def test_a_stream_reports_the_failed_choice_in_band():
    engine = OneChoiceFails()
    events = sse_payloads(run(post(engine, "/v1/completions", {"prompt": "a b", "max_tokens": 3, "n": 2, "stream": True})))
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert "not finite" in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_a_json_body_whose_engine_died_is_a_503_not_a_cut_off_200():
    """Engine death is nobody's request fault: the non-streaming client gets the dead engine's 503."""
    engine = OneChoiceFails()
    engine.dead_reason = "worker 1 died"
    response = run(post(engine, "/v1/completions", {"prompt": "a b", "max_tokens": 3, "n": 2}))
    assert response.status_code == 503, response.text
    assert "worker" not in response.json()["error"]["message"], "internals leaked"
