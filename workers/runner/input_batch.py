"""Each rank's own copy of request state, kept in step with SchedulerOutput deltas."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.outputs import SchedulerOutput
from scheduler.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    # Request id.
    req_id: str
    # Prompt + generated tokens known to this rank.
    token_ids: list[int]
    # Prompt length (the rest of token_ids are outputs).
    num_prompt_tokens: int
    # Sampling parameters.
    params: SamplingParams
    # Block table, in token order.
    block_ids: list[int]
    # Tokens already in the KV cache.
    num_computed_tokens: int
    # Per-request generator when seeded (rank 0 samples).
    generator: torch.Generator | None
    # Prompt tokens scored for prompt_logprobs so far (up to this index): a prompt recomputed
    # after preemption is not scored again.
    num_prompt_logprobs_scored: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class RequestStates:
    def __init__(self) -> None:
        self.states: dict[str, CachedRequestState] = {}

    def update(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            generator = None
            if new.sampling_params.seed is not None:
                generator = torch.Generator().manual_seed(new.sampling_params.seed)
            self.states[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=len(new.token_ids),
                params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
            )
        for cached in out.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
