"""Checks of one parsed request against this server: model name, vocabulary, size caps.

protocol.py checks what a field may hold on any server (ranges the sampler can compute with);
this module checks what depends on the served model and the config: token ids against the
vocabulary, the number and size of prompts, stops and choices. Every failure is a 400 naming the
field, raised before anything reaches the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deployments.http.errors import bad_request, model_not_found
from deployments.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request (crosses config -> HTTP layer); defaults are TpserveConfig's."""

    # Largest body in bytes (413 above).
    max_request_body_bytes: int = 4 * 1024 * 1024
    # Deepest JSON nesting of a body.
    max_json_depth: int = 32
    # Most characters of one completions prompt, or of all chat messages together.
    max_prompt_chars: int = 1_000_000
    # Most prompts in one completions request.
    max_prompts_per_request: int = 64
    # Most engine requests (prompts x n) one HTTP request may start.
    max_choices_per_request: int = 64
    # Most stop strings, characters per stop string, stop token ids.
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    # Most messages in one chat conversation.
    max_messages_per_request: int = 1024

    @classmethod
    def from_config(cls, config: Any) -> "RequestLimits":
        # What the server could ever run at once, and at most its share of the waiting queue.
        share = max(1, int(config.max_waiting_share * config.max_waiting_requests))
        return cls(
            max_request_body_bytes=config.max_request_body_bytes,
            max_json_depth=config.max_json_depth,
            max_prompt_chars=config.max_prompt_chars,
            max_prompts_per_request=config.max_prompts_per_request,
            max_choices_per_request=min(config.max_num_seqs, share),
            max_stop_strings=config.max_stop_strings,
            max_stop_string_chars=config.max_stop_string_chars,
            max_stop_token_ids=config.max_stop_token_ids,
            max_messages_per_request=config.max_messages_per_request,
        )


def model_max_tokens(defaults: Any, fallback: int | None) -> int | None:
    """The output cap when the client names none: generation_config.json's max_new_tokens,
    else the endpoint's own default (None = as much as the context leaves)."""
    value = getattr(defaults, "max_tokens", None)
    return value if value is not None else fallback


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise model_not_found(requested)


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Every id in [0, vocab_size): an id outside would index past the embedding or the logits."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"token id {token_id} is outside the vocabulary (ids 0..{vocab_size - 1})", param)


def _check_stops(request: SamplingRequest, limits: RequestLimits, vocab_size: int) -> None:
    stops = request.stop_strings()
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"at most {limits.max_stop_strings} stop strings are allowed, got {len(stops)}", "stop")
    for stop in stops:
        if not stop:
            raise bad_request("stop strings must not be empty", "stop")
        if len(stop) > limits.max_stop_string_chars:
            raise bad_request(
                f"a stop string may have at most {limits.max_stop_string_chars} characters, got {len(stop)}", "stop"
            )
    stop_ids = request.stop_token_ids or []
    if len(stop_ids) > limits.max_stop_token_ids:
        raise bad_request(
            f"at most {limits.max_stop_token_ids} stop_token_ids are allowed, got {len(stop_ids)}", "stop_token_ids"
        )
    check_token_ids(stop_ids, vocab_size, "stop_token_ids")


def _check_logit_bias(request: SamplingRequest, vocab_size: int) -> None:
    bias = getattr(request, "logit_bias", None) or {}
    check_token_ids((int(key) for key in bias), vocab_size, "logit_bias")


def _check_choices(num_prompts: int, n: int, limits: RequestLimits) -> None:
    if num_prompts * n > limits.max_choices_per_request:
        raise bad_request(
            f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; this server "
            f"runs at most {limits.max_choices_per_request} for one request",
            "n",
        )


def check_common(request: SamplingRequest, served_model: str, limits: RequestLimits, vocab_size: int) -> None:
    """What both endpoints check before any tokenizing."""
    check_model(request.model, served_model)
    _check_stops(request, limits, vocab_size)
    _check_logit_bias(request, vocab_size)


def check_completion_prompts(
    request: CompletionRequest, prompts: Sequence[str | list[int]], limits: RequestLimits, vocab_size: int
) -> None:
    """Count, size and token ids of the prompts of a completions request (before tokenizing)."""
    if len(prompts) > limits.max_prompts_per_request:
        raise bad_request(
            f"at most {limits.max_prompts_per_request} prompts per request are allowed, got {len(prompts)}", "prompt"
        )
    _check_choices(len(prompts), request.n, limits)
    for prompt in prompts:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("a prompt must not be the empty string", "prompt")
            if len(prompt) > limits.max_prompt_chars:
                raise bad_request(
                    f"a prompt may have at most {limits.max_prompt_chars} characters, got {len(prompt)}", "prompt"
                )
        else:
            check_token_ids(prompt, vocab_size, "prompt")


def conversation_chars(messages: Iterable[Mapping[str, Any]]) -> int:
    """Every character the template receives: each field's name and value (role, name, content
    and any other field), not only the content. A message with no content still renders as a
    header and costs tokens; counting it is what bounds a flood of content-less messages."""
    total = 0
    stack: list[Any] = list(messages)
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, Mapping):
            total += sum(len(str(key)) for key in value)
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif value is not None:
            total += len(str(value))
    return total


def check_conversation_size(messages: Sequence[Mapping[str, Any]], limits: RequestLimits) -> None:
    """Number of messages and their characters, before the template renders them (chat and
    /tokenize); the rendered text is checked again before it is tokenized (prompts.py)."""
    if len(messages) > limits.max_messages_per_request:
        raise bad_request(
            f"at most {limits.max_messages_per_request} messages per request are allowed, got {len(messages)}",
            "messages",
        )
    num_chars = conversation_chars(messages)
    if num_chars > limits.max_prompt_chars:
        raise bad_request(
            f"the messages may have at most {limits.max_prompt_chars} characters in all (roles, names and "
            f"content), got {num_chars}", "messages"
        )


def check_chat_messages(request: ChatCompletionRequest, limits: RequestLimits) -> list[dict[str, Any]]:
    """Size of the conversation (before rendering the template) and the number of choices;
    returns the messages as the template receives them."""
    _check_choices(1, request.n, limits)
    messages = request.template_messages()
    check_conversation_size(messages, limits)
    return messages
