"""Request bodies of the OpenAI API (completions, chat completions) and their SamplingParams.

Unknown fields are ignored, as vLLM does (and unlike OpenAI, which rejects them): clients and
SDKs routinely send fields a server has no use for (`store`, `metadata`, `service_tier`, ...),
and breaking them buys nothing. The serving layer logs the names it ignored. Fields that OpenAI
defines but tpserve cannot honour (`suffix`, tools,
`best_of` > n) are declared here and rejected with a 400, so a
client never silently gets something other than what it asked for.

Validation errors raised here become 400 OpenAI errors naming the field (deployments/http/errors.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.http.response_format import ResponseFormat
from scheduler.sampling_params import SamplingParams
from workers.model.generation_defaults import GenerationDefaults

# Most top logprobs a request may ask for (OpenAI's limit for chat; vLLM's default cap).
MAX_LOGPROBS = 20
# Most choices per prompt: each one is its own engine request sharing the prompt.
MAX_N = 16
# Largest integer a count field may hold: bounded so no arithmetic on it ever leaves int32/int64.
MAX_INT32 = 2**31 - 1
# Smallest repetition penalty: logits are divided or multiplied by it, so 1e-50 made them
# infinite and the sampler failed (issue 12); 0.01 keeps a float32 logit finite.
MIN_REPETITION_PENALTY = 0.01
# Longest per-request prefix-cache salt, in characters.
MAX_CACHE_SALT_CHARS = 256
# Longest deadline a request may ask for, in seconds (a day: any longer is no deadline at all).
MAX_REQUEST_TIMEOUT_S = 86_400.0
# Most logit_bias entries (OpenAI allows 300) and the range of one bias (OpenAI's).
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ABS_LOGIT_BIAS = 100.0


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # Send one extra chunk with `usage` (and no choices) before `data: [DONE]`.
    include_usage: bool = False
    # vLLM extension: every chunk carries the usage of its choice so far.
    continuous_usage_stats: bool = False


class TpserveOptions(BaseModel):
    """tpserve's own per-request options, under the body field `"tpserve"`."""

    model_config = ConfigDict(extra="forbid")

    # Attach the per-request `metrics` object (METRICS.md section 2 intervals) to the response.
    return_metrics: bool = False


class SamplingRequest(BaseModel):
    """The fields completions and chat share: model, sampling, stopping, streaming."""

    # allow_inf_nan=False: "Infinity" / "NaN" strings never reach the sampler as floats.
    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)

    # Served model name; None = the one model this server serves (vLLM behaviour).
    model: str | None = None
    # Most tokens to generate; None = 16 for completions, the rest of the context for chat.
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    # Fewest tokens before EOS / stop tokens may end the output (vLLM extension).
    min_tokens: int = Field(default=0, ge=0, le=MAX_INT32)
    # Choices per prompt.
    n: int = Field(default=1, ge=1, le=MAX_N)
    # 0 = greedy; OpenAI's range.
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    # Nucleus mass in (0, 1].
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # Keep the k most likely tokens; 0 or -1 = off (vLLM extension).
    top_k: int = Field(default=0, ge=-1, le=MAX_INT32)
    # Relative probability floor (vLLM extension).
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    # OpenAI penalties on generated tokens.
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # HF/vLLM repetition penalty over prompt and output (1 = off).
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=2.0)
    # Seed of choice i is seed + i, so choice 0 of an n>1 request equals the same request with n=1.
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    # Strings that end the output (not included in it).
    stop: str | list[str] | None = None
    # Token ids that end the output besides EOS (vLLM extension).
    stop_token_ids: list[int] | None = None
    # Keep generating past EOS (vLLM extension; load tests).
    ignore_eos: bool = False
    # Drop special tokens from the text (vLLM extension).
    skip_special_tokens: bool = True
    # Answer with server-sent events.
    stream: bool = False
    # Streaming extras; only allowed with stream=true (as vLLM).
    stream_options: StreamOptions | None = None
    # End-user id: accepted, ignored.
    user: str | None = None
    # Token id (as a string key, OpenAI's form) -> bias in [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = None
    # tpserve options (per-request metrics).
    tpserve: TpserveOptions | None = None
    # Prefix-cache salt (vLLM extension): requests share cached prefixes only with the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # Seconds this request may take end to end before it is aborted (its KV freed) and answered
    # 408 (in-band once streaming). It can only shorten the server's `request_timeout_s`.
    request_timeout_s: float | None = Field(default=None, gt=0, le=MAX_REQUEST_TIMEOUT_S)
    # Constrain the output to JSON (any object, or valid against a schema); both endpoints.
    response_format: ResponseFormat | None = None
    # vLLM extension (completions only): per prompt token, its logprob and rank + this many top.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Many clients send `"temperature": null` for "unset"; OpenAI accepts it, so do we.
        if isinstance(data, dict):
            return {
                key: value
                for key, value in data.items()
                if value is not None
                or key not in cls.model_fields
                or cls.model_fields[key].default is None
            }
        return data

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_not_negative(cls, value: list[int] | None) -> list[int] | None:
        if value and min(value) < 0:
            raise ValueError("stop_token_ids must be non-negative token ids")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key[:20]!r}")
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")
        return value

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(key), bias) for key, bias in (self.logit_bias or {}).items())

    @model_validator(mode="after")
    def _check_streaming_and_lengths(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    # ---- derived values the serving layer uses -------------------------------------------

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def asks_for_metrics(self) -> bool:
        return self.tpserve is not None and self.tpserve.return_metrics

    @property
    def ignored_fields(self) -> list[str]:
        """Names of unknown fields the request carried (logged, then ignored)."""
        return sorted((self.model_extra or {}).keys())

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_max_tokens(self) -> int | None:
        """The client's output-length cap (chat overrides it with max_completion_tokens)."""
        return self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """SamplingParams.logprobs: top-N per position, or None for no logprobs."""
        raise NotImplementedError

    def prompt_logprobs_count(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling_params(self, max_tokens: int, choice_index: int,
                           defaults: GenerationDefaults | None = None) -> SamplingParams:
        """The engine parameters of one choice: the seed is offset by the choice index; the
        model's generation_config.json `defaults` fill the sampling fields the client left out."""
        params = self._client_sampling_params(max_tokens, choice_index)
        if defaults is None:
            return params
        overrides = defaults.sampling_overrides(self.model_fields_set)
        overrides.pop("max_tokens", None)  # the serving layer resolves the length cap
        return dataclasses.replace(params, **overrides) if overrides else params

    def _client_sampling_params(self, max_tokens: int, choice_index: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=None if self.seed is None else self.seed + choice_index,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            stop=self.stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=self.top_logprobs_count(),
            prompt_logprobs=self.prompt_logprobs_count(),
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias_pairs(),
            cache_salt=self.cache_salt,
            structured_output=self.response_format.to_spec() if self.response_format else None,
        )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    # Prepend the prompt to each choice's text.
    echo: bool = False
    # Top logprobs per generated token (legacy completions format), 0..20.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Only best_of == n is supported (no server-side ranking).
    best_of: int | None = Field(default=None, ge=1)
    # Insertion suffix: not supported.
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be an empty list")
            if any(isinstance(p, list) and not p for p in value):
                raise ValueError("a token-id prompt must not be empty")
            if any(isinstance(p, int) and p < 0 for p in value) or any(
                isinstance(p, list) and min(p) < 0 for p in value
            ):
                raise ValueError("token ids must be non-negative")
        return value

    @model_validator(mode="after")
    def _check_unsupported(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (server-side ranking is not supported)")
        return self

    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        # echo + logprobs lists the prompt's tokens too (legacy format), from prompt logprobs.
        echoed = self.logprobs if self.echo else None
        return max((n for n in (self.prompt_logprobs, echoed) if n is not None), default=None)

    def prompt_list(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a token-id list."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # Only text parts: tpserve serves text-only models.
    type: Literal["text"]
    # The text of this part.
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # "developer" is OpenAI's newer name for "system"; tool messages are not supported.
    role: Literal["system", "developer", "user", "assistant"]
    # A string or a list of text parts (joined); None only for an empty assistant turn.
    content: str | list[TextContentPart] | None = None
    # Optional participant name (passed to the template, which may ignore it).
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    # The conversation, rendered with the model's chat template.
    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's newer name for max_tokens; wins when both are given.
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    # Return the logprob of each generated token.
    logprobs: bool = False
    # Also return the N most likely alternatives per position (needs logprobs=true).
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Append the assistant header so the model answers (vLLM extension).
    add_generation_prompt: bool = True
    # Tool calling is not supported: rejected unless absent/empty/"none".
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _check_unsupported(self) -> "ChatCompletionRequest":
        if self.tools or self.functions:
            raise ValueError("tools and functions are not supported")
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            raise ValueError("tool_choice / function_call are not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is supported on /v1/completions only")
        limit = self.requested_max_tokens()
        if limit is not None and self.min_tokens > limit:
            raise ValueError("min_tokens must not exceed max_completion_tokens")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_count(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict[str, str]]:
        return [m.for_template() for m in self.messages]
