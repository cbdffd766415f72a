"""Prompt logprobs (vLLM's `prompt_logprobs`): for every prompt position a step computes, the
log-softmax of the model's raw logits scores the NEXT prompt token (its logprob and rank) and
lists the top-N alternatives.

The hidden states of a prefill chunk are all there; only requests that asked get their rows
projected to logits. Logits are computed in slices of rows (every rank takes part in each
slice's gather, the same slices on every rank), reduced on the device, and come back to the host
in one transfer. The last prompt position is not a prompt logprob: its logits pick the first
output token (the sampler's row).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from scheduler.outputs import PromptPositionLogprobs
from workers.runner.input_batch import CachedRequestState

# Rows projected to logits at once: bounds the [rows, vocab] float32 temporaries of a long chunk.
LOGITS_SLICE_ROWS = 512


@dataclass
class PromptLogprobPlan:
    # Request id per scored position, grouped by request in step order.
    req_ids: list[str]
    # Row of the step's hidden states whose logits score the position.
    rows: list[int]
    # The prompt token those logits must score (the token after the row's own).
    target_ids: list[int]
    # Index of that token in the prompt.
    positions: list[int]
    # Request id -> top alternatives it asked for.
    num_top: dict[str, int]


def plan_prompt_logprobs(num_scheduled_tokens: Mapping[str, int],
                         states: Mapping[str, CachedRequestState]) -> PromptLogprobPlan | None:
    """Which hidden rows score prompt tokens this step. Rows follow the runner's layout: one-token
    requests first, then the multi-token chunks, each in scheduling order. Must run before the
    step advances num_computed_tokens. None when no request asks."""
    asking = [r for r in num_scheduled_tokens if states[r].params.prompt_logprobs is not None]
    if not asking:
        return None
    plan = PromptLogprobPlan([], [], [], [], {})
    order = [r for r, n in num_scheduled_tokens.items() if n == 1]
    order += [r for r, n in num_scheduled_tokens.items() if n != 1]
    first_row = 0
    for req_id in order:
        state = states[req_id]
        num = num_scheduled_tokens[req_id]
        if state.params.prompt_logprobs is not None:
            start = state.num_computed_tokens
            first = max(start, state.num_prompt_logprobs_scored)  # not again after a preemption
            # Position p's logits score prompt token p + 1; the last prompt position samples.
            for pos in range(first, min(start + num, state.num_prompt_tokens - 1)):
                plan.req_ids.append(req_id)
                plan.rows.append(first_row + pos - start)
                plan.target_ids.append(state.token_ids[pos + 1])
                plan.positions.append(pos + 1)
            plan.num_top[req_id] = max(state.params.prompt_logprobs, 0)
        first_row += num
    return plan if plan.rows else None


def mark_scored(plan: PromptLogprobPlan, states: Mapping[str, CachedRequestState]) -> None:
    """Remember how far each request's prompt is scored (on every rank, like the plan)."""
    for req_id, position in zip(plan.req_ids, plan.positions):
        states[req_id].num_prompt_logprobs_scored = position


def compute_prompt_logprobs(compute_logits, hidden: torch.Tensor,
                            plan: PromptLogprobPlan) -> dict[str, list[PromptPositionLogprobs]] | None:
    """Every rank calls this with the same plan (the logits gather is collective); the first
    rank gets the entries per request id, the others None."""
    device = hidden.device
    rows = torch.tensor(plan.rows, dtype=torch.long).to(device, non_blocking=True)
    targets = torch.tensor(plan.target_ids, dtype=torch.long).to(device, non_blocking=True)
    num_top = max(plan.num_top.values())
    actual_parts, rank_parts, top_value_parts, top_id_parts = [], [], [], []
    for begin in range(0, len(plan.rows), LOGITS_SLICE_ROWS):
        end = begin + LOGITS_SLICE_ROWS
        logits = compute_logits(hidden[rows[begin:end]])
        if logits is None:
            continue  # not the first rank: it only took part in the gather
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        actual = logprobs.gather(1, targets[begin:end, None])
        actual_parts.append(actual.reshape(-1))
        # Rank as vLLM counts it: 1 + how many tokens are strictly more likely.
        rank_parts.append((logprobs > actual).sum(dim=-1) + 1)
        if num_top:
            top = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
            top_value_parts.append(top.values.reshape(-1))
            top_id_parts.append(top.indices.reshape(-1))
    if not actual_parts:
        return None
    parts = actual_parts + rank_parts + top_value_parts + top_id_parts
    # The one device -> host transfer (ids and ranks are exact in float64).
    host = torch.cat([p.to(torch.float64) for p in parts]).tolist()
    return _unpack(host, plan, min(num_top, logits.shape[-1]))


def _unpack(host: list[float], plan: PromptLogprobPlan, num_top: int) -> dict[str, list[PromptPositionLogprobs]]:
    num = len(plan.rows)
    values_at, ids_at = 2 * num, 2 * num + num * num_top
    result: dict[str, list[PromptPositionLogprobs]] = {}
    for i, req_id in enumerate(plan.req_ids):
        wanted = min(plan.num_top[req_id], num_top)
        values = host[values_at + i * num_top : values_at + i * num_top + wanted]
        ids = host[ids_at + i * num_top : ids_at + i * num_top + wanted]
        result.setdefault(req_id, []).append(PromptPositionLogprobs(
            position=plan.positions[i],
            actual=(plan.target_ids[i], host[i], int(host[num + i])),
            top=[(int(t), v) for t, v in zip(ids, values)],
        ))
    return result
