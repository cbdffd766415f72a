"""One request's row in a sampling batch: what the sampler and its request processors
(penalties, logit_bias, min_tokens, allowed-token mask) read. Its own module so the sampler and
the processors both depend on it and not on each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    # Packed int32 allowed-token bitmask for this step (xgrammar's layout; a list of words or a
    # 1-D int32 tensor), None = every token allowed.
    allowed_token_bitmask: list[int] | torch.Tensor | None = None
