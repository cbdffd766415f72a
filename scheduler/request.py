"""A request as the scheduler sees it: tokens, progress, KV blocks, recorded events."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from metrics.events import EventType, RequestEvent, now
from scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to recompute after an eviction
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


class Request:
    """Mutable scheduler-side state of one sequence (one choice of an OpenAI request)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: int | Iterable[int] | None,
        queued_ts: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # Every id that ends the request as EOS (Llama 3 lists several in generation_config.json).
        self.eos_token_ids: frozenset[int] = _as_id_set(eos_token_ids)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        # Tokens whose K/V are in the cache (prefix hits included); reset to 0 by preemption.
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at first admission (reported as cached_tokens).
        self.num_cached_prompt_tokens = 0
        self.num_preemptions = 0
        # Why the request failed alone (sampling, detokenization, ...): set with FINISHED_ABORTED.
        self.error: str | None = None
        # Events not yet drained by the engine (take_events) and the full history (timelines).
        self._pending_events: list[RequestEvent] = []
        self.record(EventType.QUEUED, queued_ts)

    # ---- tokens -------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens: what must be in the KV cache before the next sample."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the concatenation."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def is_prefill_done(self) -> bool:
        """Has the request ever produced a token (decode phase for preemption accounting)."""
        return bool(self.output_token_ids)

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_token_ids

    # ---- events -------------------------------------------------------------------------
    def record(self, event_type: EventType, ts: float | None = None) -> None:
        self._pending_events.append(RequestEvent(event_type, now() if ts is None else ts))

    def take_events(self) -> list[RequestEvent]:
        events, self._pending_events = self._pending_events, []
        return events

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


def _as_id_set(ids: int | Iterable[int] | None) -> frozenset[int]:
    if ids is None:
        return frozenset()
    if isinstance(ids, int):
        return frozenset((ids,))
    return frozenset(ids)
