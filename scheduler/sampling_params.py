"""Per-request sampling and stopping parameters (crosses scheduler -> workers -> engine)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must parse as (the OpenAI `response_format`); the engine turns it into a
    grammar and the sampler into a token mask per step."""

    # "json_object" (any JSON object) or "json_schema" (JSON valid against `json_schema`).
    kind: str
    # The schema as JSON text in the client's key order (properties are generated in declared
    # order, so keys must not be sorted); "" for json_object. Hashable: grammars cache per schema.
    json_schema: str = ""


@dataclass(frozen=True)
class SamplingParams:
    # Most tokens to generate.
    max_tokens: int = 16
    # Fewest tokens to generate before EOS / stop tokens may end the request.
    min_tokens: int = 0
    # 0 means greedy.
    temperature: float = 1.0
    # Nucleus sampling mass (1.0 = off).
    top_p: float = 1.0
    # Keep only the k most likely tokens (0 or -1 = off).
    top_k: int = 0
    # Drop tokens whose probability is below min_p x the top probability (0 = off).
    min_p: float = 0.0
    # Per-request seed: the same tokens whatever else is in the batch (None = unseeded).
    seed: int | None = None
    # OpenAI presence penalty, subtracted once per distinct generated token.
    presence_penalty: float = 0.0
    # OpenAI frequency penalty, subtracted per occurrence of a generated token.
    frequency_penalty: float = 0.0
    # HF/vLLM repetition penalty over prompt and output tokens (1.0 = off).
    repetition_penalty: float = 1.0
    # Keep generating past EOS.
    ignore_eos: bool = False
    # Strings that end generation (excluded from the output text).
    stop: tuple[str, ...] = ()
    # Token ids that end generation (besides EOS).
    stop_token_ids: tuple[int, ...] = ()
    # Return this many top logprobs per sampled position (None = no logprobs).
    logprobs: int | None = None
    # Return, for every prompt token after the first, its logprob and rank plus this many top
    # alternatives (vLLM's prompt_logprobs; None = none). Such a request takes no prefix-cache
    # hits: cached positions have no logits.
    prompt_logprobs: int | None = None
    # Skip special tokens when detokenizing.
    skip_special_tokens: bool = True
    # Constrain the output to a grammar (None = free text). The engine keeps the matcher.
    structured_output: StructuredOutputSpec | None = None
    # OpenAI logit_bias: (token id, bias) pairs added to the logits after the penalties (a dict
    # {id: bias} is accepted and stored sorted by id).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Prefix-cache salt: folded into the first block's hash, so requests share cached prefixes
    # only with requests carrying the same salt (None = the shared, unsalted cache).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # Tuples keep the object hashable and cheap to pickle; accept lists from callers.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
