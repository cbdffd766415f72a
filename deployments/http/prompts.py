"""Prompt text -> token ids on a thread pool, so tokenizing never runs on the event loop.

The event loop of a replica also writes every SSE stream and answers /health; a long prompt (or a
chat template over a long conversation) tokenized there would stall all of them. Each call here
runs on the shared pool and returns plain lists.

Each check runs as soon as what it needs is known, so a request that must fail holds the pool as
little as possible: a text prompt that cannot fit the context whatever its tokens is refused
before it is tokenized (`PromptChecks.max_chars_per_token`); a rendered chat prompt is measured
before it is tokenized; each prompt's token count is checked right after its own tokenization
(the next prompt of the request is not tokenized); and ids made from text are checked against the
model's embedding size (a tokenizer larger than the embedding would otherwise reach the model).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from deployments.http.errors import bad_request
from scheduler.admission import AdmissionLimits, check_admission
from scheduler.math_utils import cdiv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptChecks:
    """What a prompt must satisfy, checked on the pool (crosses the serving code -> PromptTokenizer)."""

    # Token ids made from text must be below this (the model's embedding rows, capped by the
    # tokenizer's size: api_server's vocab_size_of).
    vocab_size: int
    # The engine's bounds on one request: a prompt of max_request_tokens tokens or more can
    # never run (None = not checked here, e.g. /tokenize, which only counts).
    admission_limits: AdmissionLimits | None
    # Most characters of a rendered chat prompt (the template's own text included).
    max_prompt_chars: int
    # The request field the prompt came from ("prompt", "messages"), named in errors.
    param: str


class PromptTokenizer:
    """Tokenizes completions prompts and renders chat conversations on `pool`."""

    def __init__(self, tokenizer: Any, pool: Executor | None) -> None:
        # The engine's HF tokenizer (or any object with encode/decode/apply_chat_template).
        self.tokenizer = tokenizer
        # Where the work runs; None = inline (only for tests with a trivial tokenizer).
        self.pool = pool
        # Longest text one token can stand for, in characters (None = unknown: no early bound);
        # computed on first use, on the pool.
        self._max_chars_per_token: int | None = None
        self._max_chars_known = False

    async def run(self, fn, *args):
        """`fn(*args)` on the pool (tokenizer-heavy work stays off the event loop)."""
        if self.pool is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- checks ---------------------------------------------------------------------------
    @property
    def max_chars_per_token(self) -> int | None:
        """The most characters any one token covers: the longest vocabulary entry (byte-level
        BPE spells each byte as one character, so an entry is never shorter than the text it
        stands for). None when the tokenizer normalizes text first (a normalizer may merge or drop
        characters, so the bound would not hold) or lists no vocabulary."""
        if not self._max_chars_known:
            self._max_chars_per_token = _longest_token_chars(self.tokenizer)
            self._max_chars_known = True
        return self._max_chars_per_token

    def _check_text_fits(self, text: str, checks: PromptChecks) -> None:
        """Refuse before tokenizing a text that has more tokens than the context whatever they
        are: at least len(text) / max_chars_per_token of them."""
        per_token = self.max_chars_per_token
        if checks.admission_limits is None or per_token is None:
            return
        fewest_tokens = cdiv(len(text), per_token)
        if fewest_tokens >= checks.admission_limits.max_request_tokens:
            check_admission(fewest_tokens, 1, checks.admission_limits, checks.param, checks.param)

    @staticmethod
    def _check_ids(token_ids: list[int], checks: PromptChecks) -> None:
        """Token count (context) first, then every id against the embedding."""
        if checks.admission_limits is not None and len(token_ids) >= checks.admission_limits.max_request_tokens:
            check_admission(len(token_ids), 1, checks.admission_limits, checks.param, checks.param)
        if token_ids:
            highest = max(token_ids)
            if highest >= checks.vocab_size:
                raise bad_request(
                    f"the {checks.param} text encodes to token id {highest}, which this model does not have "
                    f"(its vocabulary has ids 0..{checks.vocab_size - 1})", checks.param,
                )

    # ---- completions ----------------------------------------------------------------------
    def _encode_all(self, prompts: Sequence[str | list[int]], echo: bool,
                    checks: PromptChecks | None) -> tuple[list[list[int]], list[str]]:
        token_lists, texts = [], []
        for prompt in prompts:
            if isinstance(prompt, str):
                if checks is not None:
                    self._check_text_fits(prompt, checks)
                token_ids = list(self.tokenizer.encode(prompt))
                if checks is not None:
                    self._check_ids(token_ids, checks)
                token_lists.append(token_ids)
                texts.append(prompt)
            else:
                token_lists.append(list(prompt))
                texts.append(self.tokenizer.decode(prompt) if echo else "")
        return token_lists, texts

    async def completion_prompts(
        self, prompts: Sequence[str | list[int]], echo: bool, checks: PromptChecks | None = None
    ) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt (ids pass through), and its text (decoded for echo). With
        `checks`, text prompts are checked as they are tokenized (AdmissionError or a 400)."""
        return await self.run(self._encode_all, prompts, echo, checks)

    # ---- chat -----------------------------------------------------------------------------
    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     checks: PromptChecks | None) -> list[int]:
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # the template's own checks (roles must alternate, ...)
            raise bad_request(_template_error_message(exc), "messages") from None
        if not isinstance(rendered, str):
            # A tokenizer whose template always returns ids (transformers < 5 with some
            # wrappers): nothing to measure before tokenizing, the ids are checked below.
            token_ids = list(rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)
        else:
            if checks is not None:
                if len(rendered) > checks.max_prompt_chars:
                    raise bad_request(
                        f"the conversation renders to {len(rendered)} characters with the chat template; at "
                        f"most {checks.max_prompt_chars} are allowed", "messages",
                    )
                self._check_text_fits(rendered, checks)
            # What apply_chat_template(tokenize=True) does: the template wrote the special tokens.
            token_ids = list(self.tokenizer.encode(rendered, add_special_tokens=False))
        if checks is not None:
            self._check_ids(token_ids, checks)
        return token_ids

    async def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          checks: PromptChecks | None = None) -> list[int]:
        """Token ids of the conversation rendered with the model's chat template."""
        return await self.run(self._render_chat, messages, add_generation_prompt, checks)


def _longest_token_chars(tokenizer: Any) -> int | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - no vocabulary to read: no early bound
        return None
    return max((len(token) for token in vocab), default=None) or None


def _template_error_message(exc: Exception) -> str:
    """A template's own `raise_exception(...)` text is meant for clients; anything else is ours."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers depends on jinja2
        TemplateError = ()  # type: ignore[assignment]
    if isinstance(exc, (TemplateError, ValueError)):
        return f"cannot apply the chat template: {exc}"
    logger.error("chat template failed", exc_info=exc)
    return "cannot apply the chat template to these messages"
