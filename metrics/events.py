"""Request events (METRICS.md section 1), stamped with one monotonic clock."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass


def now() -> float:
    """The single clock of tpserve: every event and interval uses it so they compare exactly."""
    return time.monotonic()


class EventType(str, enum.Enum):
    # Frontend (HTTP side): request received, before tokenization.
    ARRIVED = "ARRIVED"
    # The engine accepted the request into its waiting queue.
    QUEUED = "QUEUED"
    # Taken from waiting into running: the first time and again after every preemption.
    SCHEDULED = "SCHEDULED"
    # Evicted by the scheduler: blocks freed, back to the head of waiting, recompute later.
    PREEMPTED = "PREEMPTED"
    # A step produced output token(s) for the request; one timestamp per step.
    NEW_TOKENS = "NEW_TOKENS"
    # A step computed a chunk of the request's prompt (or of its recomputation after a
    # preemption) and sampled nothing: the prefill goes on in a later step. The chunk that
    # completes the prefill is marked by its NEW_TOKENS instead. Traces draw one span per chunk;
    # no interval rule uses it.
    PREFILL_CHUNK = "PREFILL_CHUNK"
    # Stop, length or abort.
    FINISHED = "FINISHED"
    # Frontend: first token handed to the client (TTFT is measured to here).
    FIRST_TOKEN_SENT = "FIRST_TOKEN_SENT"
    # Frontend: last byte of the response handed to the server.
    RESPONDED = "RESPONDED"


@dataclass(frozen=True)
class RequestEvent:
    # What happened.
    type: EventType
    # When, on the clock of `now()` (time.monotonic()).
    ts: float
