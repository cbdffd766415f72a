"""POST /tokenize and /detokenize in vLLM's shapes (evaluation harnesses and clients that count
tokens against the context use them). Same caps, vocabulary checks and thread pool as the
OpenAI routes: nothing is tokenized on the event loop.

    /tokenize    {"prompt": "..."} or {"messages": [...]}  -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [...]}                          -> {"prompt": "..."}
"""

from __future__ import annotations

import functools

from concurrent.futures import Executor
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.engine.client import EngineClient
from deployments.http.body import parse_body
from deployments.http.errors import bad_request
from deployments.http.prompts import PromptChecks, PromptTokenizer
from deployments.http.protocol import ChatMessage
from deployments.http.validation import RequestLimits, check_conversation_size, check_model, check_token_ids


class TokenizeRequest(BaseModel):
    """A completions prompt or a chat conversation to turn into token ids."""

    model_config = ConfigDict(extra="ignore")

    # The served model's name (optional, as in vLLM).
    model: str | None = None
    # Text to tokenize (exclusive with `messages`).
    prompt: str | None = None
    # A conversation rendered with the chat template (exclusive with `prompt`).
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # Chat only: append the assistant header, as the chat endpoint does by default.
    add_generation_prompt: bool = True
    # Prompt only: add the tokenizer's special tokens (BOS), as /v1/completions does.
    add_special_tokens: bool = True
    # Also return each token's string form.
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """Token ids to turn back into text."""

    model_config = ConfigDict(extra="ignore")

    # The served model's name (optional).
    model: str | None = None
    # The ids (each checked against the vocabulary).
    tokens: list[int] = Field(max_length=1_000_000)


def add_tokenize_routes(app: FastAPI, engine: EngineClient, limits: RequestLimits, pool: Executor, vocab_size: int) -> None:
    prompts = PromptTokenizer(engine.tokenizer, pool)
    tokenizer = engine.tokenizer

    async def token_ids(body: TokenizeRequest) -> list[int]:
        if body.messages is not None:
            messages = [m.for_template() for m in body.messages]
            check_conversation_size(messages, limits)
            # Sizes only: /tokenize counts tokens, it does not refuse a prompt over the context.
            checks = PromptChecks(vocab_size, None, limits.max_prompt_chars, "messages")
            return await prompts.chat_prompt(messages, body.add_generation_prompt, checks)
        if len(body.prompt) > limits.max_prompt_chars:
            raise bad_request(f"a prompt may have at most {limits.max_prompt_chars} characters", "prompt")
        # Keyword, not positional: encode's second positional parameter is `text_pair`.
        encode = functools.partial(tokenizer.encode, add_special_tokens=body.add_special_tokens)
        return list(await prompts.run(encode, body.prompt))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest, limits.max_request_body_bytes, limits.max_json_depth, pool)
        check_model(body.model, engine.model_name)
        ids = await token_ids(body)
        strs = await prompts.run(tokenizer.convert_ids_to_tokens, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest, limits.max_request_body_bytes, limits.max_json_depth, pool)
        check_model(body.model, engine.model_name)
        check_token_ids(body.tokens, vocab_size, "tokens")
        return {"prompt": await prompts.run(tokenizer.decode, body.tokens)}
