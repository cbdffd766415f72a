"""Prompt text -> token ids on a thread pool, so tokenizing never runs on the event loop.

The event loop of a replica also writes every SSE stream and answers /health; a long prompt (or a
chat template over a long conversation) tokenized there would stall all of them. Each call here
runs on the shared pool and returns plain lists.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

from deployments.http.errors import bad_request

logger = logging.getLogger(__name__)


class PromptTokenizer:
    """Tokenizes completions prompts and renders chat conversations on `pool`."""

    def __init__(self, tokenizer: Any, pool: Executor | None) -> None:
        # The engine's HF tokenizer (or any object with encode/decode/apply_chat_template).
        self.tokenizer = tokenizer
        # Where the work runs; None = inline (only for tests with a trivial tokenizer).
        self.pool = pool

    async def run(self, fn, *args):
        """`fn(*args)` on the pool (tokenizer-heavy work stays off the event loop)."""
        if self.pool is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _encode_all(self, prompts: Sequence[str | list[int]], echo: bool) -> tuple[list[list[int]], list[str]]:
        token_lists, texts = [], []
        for prompt in prompts:
            if isinstance(prompt, str):
                token_lists.append(list(self.tokenizer.encode(prompt)))
                texts.append(prompt)
            else:
                token_lists.append(list(prompt))
                texts.append(self.tokenizer.decode(prompt) if echo else "")
        return token_lists, texts

    async def completion_prompts(
        self, prompts: Sequence[str | list[int]], echo: bool
    ) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt (ids pass through), and its text (decoded for echo)."""
        return await self.run(self._encode_all, prompts, echo)

    def _render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except Exception as exc:  # the template's own checks (roles must alternate, ...)
            raise bad_request(_template_error_message(exc), "messages") from None
        # transformers >= 5 returns a BatchEncoding here, older versions a plain list.
        if isinstance(rendered, Mapping):
            rendered = rendered["input_ids"]
        return list(rendered)

    async def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """Token ids of the conversation rendered with the model's chat template."""
        return await self.run(self._render_chat, messages, add_generation_prompt)


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
