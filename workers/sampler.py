"""Turn logits into tokens: penalties, min_tokens, temperature, top-k/p, min-p, seeds, logprobs.

Greedy rows take a fast argmax path; seeded rows draw from their own torch.Generator so their
tokens do not depend on batch mates; logprobs are the model's raw log-softmax (as vLLM returns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.outputs import SampledLogprobs
from scheduler.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    # The request's sampling parameters.
    params: SamplingParams
    # Prompt token ids (for the repetition penalty).
    prompt_token_ids: list[int]
    # Tokens generated so far (penalties, min_tokens).
    output_token_ids: list[int]
    # Tokens that end the request (EOS ids + stop_token_ids), masked while under min_tokens.
    stop_ids: tuple[int, ...]
    # The request's own generator when seeded, else None.
    generator: torch.Generator | None


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    p = row.params
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long,
                            device=logits.device)
        seen = seen[seen < vocab]
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if row.output_token_ids and (p.frequency_penalty or p.presence_penalty):
        ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab]
        logits -= p.frequency_penalty * counts.to(logits.dtype)
        logits -= p.presence_penalty * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row: temperature, then top-k, top-p and min-p as -inf masks."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop tokens once the mass before them already reaches top_p (keep at least one).
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[SampledLogprobs | None]]:
    """logits [R, V] float32 (one row per request that samples) -> token ids and logprobs."""
    want_logprobs = [r.params.logprobs is not None for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
    needs_processing = [
        r.params.needs_penalties or len(r.output_token_ids) < r.params.min_tokens for r in rows
    ]
    if any(needs_processing):
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.params.needs_penalties:
                apply_penalties(logits[i], row)
            if len(row.output_token_ids) < row.params.min_tokens and row.stop_ids:
                logits[i, list(row.stop_ids)] = float("-inf")

    token_ids = logits.argmax(dim=-1).tolist()  # right for every greedy row
    for i, row in enumerate(rows):
        if row.params.is_greedy:
            continue
        probs = filter_logits(logits[i], row.params).softmax(-1)
        if row.generator is not None and probs.device != row.generator.device:
            # Seeded rows draw from their own CPU generator: the same tokens on any device.
            probs = probs.cpu()
        token_ids[i] = int(torch.multinomial(probs, 1, generator=row.generator).item())

    logprobs: list[SampledLogprobs | None] = [None] * len(rows)
    for i, row in enumerate(rows):
        if not want_logprobs[i]:
            continue
        lp = raw_logprobs[i]
        n = row.params.logprobs
        top = torch.topk(lp, n) if n > 0 else None
        logprobs[i] = SampledLogprobs(
            sampled=(token_ids[i], float(lp[token_ids[i]])),
            top=list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
        )
    return token_ids, logprobs
