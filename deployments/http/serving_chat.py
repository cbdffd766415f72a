"""POST /v1/chat/completions: messages -> chat template -> engine -> `chat.completion` body or chunks.

Streaming sends, per choice, a first chunk with `delta: {"role": "assistant", "content": ""}`,
then `delta: {"content": ...}` chunks as text is released, then `delta: {}` with `finish_reason`
(and `metrics` when asked), then the usage chunk when asked, then `data: [DONE]`, as OpenAI does.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse

from scheduler.admission import resolve_max_tokens
from deployments.engine.client import EngineClient
from deployments.engine.outputs import PositionLogprobs, RequestOutput, TokenLogprob
from deployments.http.response_format import check_response_format
from deployments.http.choice_streams import EngineStreamResponse
from deployments.http.prompts import PromptChecks, PromptTokenizer
from deployments.http.protocol import ChatCompletionRequest
from deployments.http.serving_common import ChoiceProgress, ResponseRun
from deployments.http.validation import RequestLimits, check_chat_messages, check_common, model_max_tokens
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _token_entry(token: TokenLogprob) -> dict[str, Any]:
    return {"token": token.token, "logprob": token.logprob, "bytes": list(token.token.encode("utf-8"))}


def chat_logprob_entries(positions: list[PositionLogprobs]) -> list[dict[str, Any]]:
    """OpenAI chat logprobs `content` entries: token, logprob, bytes, top_logprobs."""
    return [
        {**_token_entry(pos.sampled), "top_logprobs": [_token_entry(t) for t in pos.top]}
        for pos in positions
    ]


class ChatServing:
    """Serves /v1/chat/completions on one AsyncEngine."""

    def __init__(self, engine: EngineClient, limits: RequestLimits, prompts: PromptTokenizer, vocab_size: int) -> None:
        self.engine = engine
        # Caps on one request (config).
        self.limits = limits
        # Renders the chat template off the event loop.
        self.prompts = prompts
        # Token ids must be below this.
        self.vocab_size = vocab_size

    async def _prepare(self, request: ChatCompletionRequest) -> tuple[list[int], list[SamplingParams]]:
        """Every check, then the prompt's token ids and each choice's parameters."""
        # Cheapest first: fields, then the conversation's size before the template renders it,
        # then the rendered text's size before it is tokenized, then its tokens; the grammar
        # compiles last, for a request that can run.
        check_common(request, self.engine.model_name, self.limits, self.vocab_size)
        messages = check_chat_messages(request, self.limits)
        if request.ignored_fields:
            logger.warning("ignoring unknown request fields: %s", ", ".join(request.ignored_fields))
        checks = PromptChecks(self.vocab_size, self.engine.admission_limits, self.limits.max_prompt_chars, "messages")
        token_ids = await self.prompts.chat_prompt(messages, request.add_generation_prompt, checks)
        max_tokens_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        defaults = getattr(self.engine, "generation_defaults", None)
        max_tokens = resolve_max_tokens(
            request.requested_max_tokens(), model_max_tokens(defaults, None), len(token_ids),
            self.engine.admission_limits, "messages", max_tokens_param,
        )
        await check_response_format(request, self.engine)
        return token_ids, [request.to_sampling_params(max_tokens, i, defaults) for i in range(request.n)]

    async def create(self, request: ChatCompletionRequest, arrival_ts: float) -> JSONResponse | EngineStreamResponse:
        token_ids, params = await self._prepare(request)
        object_name = "chat.completion.chunk" if request.stream else "chat.completion"
        run = ResponseRun.create(self.engine, request, "chatcmpl", object_name, [token_ids], [params], arrival_ts)

        def logprobs_of(out: RequestOutput) -> list[dict[str, Any]] | None:
            return chat_logprob_entries(out.new_logprobs) if request.logprobs and out.new_logprobs else None

        if request.stream:

            def render_delta(choice: ChoiceProgress, out: RequestOutput) -> dict[str, Any] | None:
                entries = logprobs_of(out)
                if not out.new_text and not entries:
                    return None
                return {
                    "index": choice.spec.index,
                    "delta": {"content": out.new_text} if out.new_text else {},
                    "logprobs": {"content": entries, "refusal": None} if entries else None,
                    "finish_reason": None,
                }

            def render_finish(choice: ChoiceProgress) -> dict[str, Any]:
                return {"index": choice.spec.index, "delta": {}, "logprobs": None, "finish_reason": choice.finish_reason}

            # The role comes first, once per choice, before any content (OpenAI framing).
            opening = [
                run.chunk(c, {"index": c.spec.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None})
                for c in run.choices
            ]
            return await run.stream_response(render_delta, render_finish, opening)

        entries_by_choice: list[list[dict[str, Any]]] = [[] for _ in run.choices]

        def on_output(choice: ChoiceProgress, out: RequestOutput) -> None:
            entries_by_choice[choice.spec.index].extend(logprobs_of(out) or [])

        await run.collect(on_output)
        return run.whole_response(
            [
                {
                    "index": choice.spec.index,
                    "message": {"role": "assistant", "content": choice.text, "refusal": None},
                    "logprobs": {"content": entries, "refusal": None} if request.logprobs else None,
                    "finish_reason": choice.finish_reason,
                }
                for choice, entries in zip(run.choices, entries_by_choice)
            ]
        )
