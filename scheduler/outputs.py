"""Objects that cross the scheduler <-> worker boundary once per step.

Small to pickle: a new request's prompt travels once; afterwards only deltas (new token ids,
new block ids, counts) do, so per-step cost does not grow with context length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    # Request id.
    req_id: str
    # All tokens the worker must know: the prompt (plus outputs, never for a brand-new request).
    token_ids: list[int]
    # Sampling parameters (rank 0 samples; other ranks ignore them).
    sampling_params: SamplingParams
    # Every block the request holds, in token order.
    block_ids: list[int]
    # Tokens already in the KV cache (prefix-cache hits) when it is first scheduled.
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    # Request id (the worker already holds its state).
    req_id: str
    # True when the request was preempted and is admitted again: `new_block_ids` then replaces
    # the whole block table, because preemption freed every block it held.
    resumed_from_preemption: bool
    # Tokens appended since the worker last saw the request (normally its last sampled token).
    new_token_ids: list[int]
    # Blocks added this step (or the full table when resumed).
    new_block_ids: list[int]
    # Tokens in the KV cache before this step's tokens.
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    # Requests the workers have not seen before, in full.
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    # Requests the workers know, as deltas.
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # Tokens to compute this step, per request id.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Σ num_scheduled_tokens.
    total_num_scheduled_tokens: int = 0
    # Requests that ended since the last step: workers drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Request id -> packed allowed-token bitmask for the token sampled this step (structured
    # output): int32 words, token t allowed when bit t % 32 of word t // 32 is set (xgrammar's
    # layout; words may be given signed or unsigned). Requests absent here may sample any token.
    allowed_token_bitmasks: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class SampledLogprobs:
    # (token id, logprob) of the sampled token.
    sampled: tuple[int, float]
    # The top-N (token id, logprob) pairs, most likely first.
    top: list[tuple[int, float]]


@dataclass
class PromptPositionLogprobs:
    # Index in the prompt of the token scored here (1.. num_prompt_tokens - 1; the first prompt
    # token has no logprob). Lets the engine drop positions it already has (a preempted request
    # recomputes its prompt).
    position: int
    # (token id, logprob, rank) of the actual prompt token; rank 1 = the most likely token.
    actual: tuple[int, float, int]
    # The top-N (token id, logprob) pairs, most likely first (rank = index + 1).
    top: list[tuple[int, float]]


@dataclass
class ModelRunnerOutput:
    # Sampled token ids per request id; a request whose prefill chunk is partial is absent.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Logprobs per request id, one entry per sampled token, for requests that asked.
    logprobs: dict[str, list[SampledLogprobs]] = field(default_factory=dict)
    # Prompt logprobs per request id for the prompt positions computed this step, in order, for
    # requests with SamplingParams.prompt_logprobs (absent for the others).
    prompt_logprobs: dict[str, list[PromptPositionLogprobs]] = field(default_factory=dict)
    # Seconds the model forward (plus sampling) took on the slowest rank.
    forward_time: float = 0.0
    # Request id -> why it got no token this step (non-finite logits, a sampler error, every
    # token excluded); only the failing requests, which the engine ends with finish_reason abort.
    request_errors: dict[str, str] = field(default_factory=dict)
