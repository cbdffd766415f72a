"""transformers' logits processors as the reference for the sampler's distributions (test helper).

`hf_reference(logits, params)` is what HF's processor chain gives one row, in `generate`'s order:
repetition penalty, frequency/presence (written out: HF has no processor for them), logit bias,
min new tokens, then temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from scheduler.sampling_params import SamplingParams as SP
from workers.sampling.row import SamplingRow

PROMPT = [5, 17, 17, 42, 50, 3]
OUTPUT = [17, 25, 25, 25, 7, 60]
# The request every reference row belongs to: a prompt and an output with repeats.
STOP_IDS = (2, 7)


def hf_reference(logits: torch.Tensor, p: SP) -> torch.Tensor:
    """The distribution HF's processors give one row (float64 softmax of float32 logits)."""
    input_ids = torch.tensor([PROMPT + OUTPUT])
    scores = logits[None].clone()
    processors = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    scores = processors(input_ids, scores)
    # OpenAI's frequency/presence penalties (vLLM's definition; HF has no processor for them).
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=scores.shape[-1]).to(scores.dtype)
    scores = scores - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(scores.dtype)
    processors = LogitsProcessorList()
    if p.logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias]))
    if p.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(len(PROMPT), p.min_tokens, list(STOP_IDS)))
    processors.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        processors.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        processors.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        processors.append(MinPLogitsWarper(p.min_p))
    return processors(input_ids, scores)[0].softmax(-1)


def row(p: SP, generator: torch.Generator | None = None, **extra) -> SamplingRow:
    """A SamplingRow of the reference request (PROMPT, OUTPUT, STOP_IDS) with parameters p."""
    return SamplingRow(params=p, prompt_token_ids=PROMPT, output_token_ids=OUTPUT, stop_ids=STOP_IDS,
                       generator=generator, **extra)
