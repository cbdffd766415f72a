"""A non-streaming body reports its own timing truthfully (issue 10, item 7): the first token is
handed over with the body, so the body's `e2e_latency` can never be shorter than its `ttft`."""

from __future__ import annotations

from deployments.engine.engine_metrics import EngineMetrics
from deployments.engine.outputs import RequestOutput
from metrics.events import EventType, RequestEvent, now


def test_body_metrics_taken_after_the_engine_finished_have_e2e_at_least_ttft():
    metrics = EngineMetrics([], timeline_capacity=4, frontend_finalizes=True)
    arrived = now() - 1.0  # the request arrived a second ago and finished 50 ms after
    metrics.on_request_added("r-0", arrived)
    events = [RequestEvent(t, arrived + 0.01 * (k + 1)) for k, t in enumerate(
        (EventType.QUEUED, EventType.SCHEDULED, EventType.NEW_TOKENS, EventType.NEW_TOKENS, EventType.FINISHED))]
    metrics.on_outputs([RequestOutput("r-0", [5, 6], " a b", None, True, "length", 3, 2, 0, events)])
    # What the HTTP layer does for a JSON body: the first token goes out with it, now.
    metrics.mark_first_token_sent("r-0")
    body = metrics.request_metrics("r-0")
    assert body["ttft"] is not None and body["e2e_latency"] is not None
    assert body["e2e_latency"] >= body["ttft"] > 0.9  # TTFT ends at the send, after FINISHED
    # Once responded, the finalized figures keep the same order.
    metrics.mark_responded("r-0")
    final = metrics.request_metrics("r-0")
    assert final["e2e_latency"] >= final["ttft"] >= body["ttft"]
