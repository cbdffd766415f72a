"""POST /v1/completions: prompts -> engine requests -> OpenAI `text_completion` body or chunks.

Streaming sends, per choice, a chunk for each engine output that released text or logprobs, then a
chunk with empty text carrying `finish_reason` (and `metrics` when asked), then the usage chunk
(`choices: []`) when `stream_options.include_usage`, then `data: [DONE]`. With `echo`, the
prompt text leads the choice's text (its first chunk when streaming).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse

from scheduler.admission import resolve_max_tokens
from deployments.engine.outputs import PositionLogprobs, PromptTokenLogprob, RequestOutput
from deployments.http.response_format import check_response_format
from deployments.http.choice_streams import EngineStreamResponse
from deployments.http.prompts import PromptTokenizer
from deployments.http.protocol import CompletionRequest
from deployments.http.serving_common import ChoiceProgress, ResponseRun
from deployments.http.validation import RequestLimits, check_common, check_completion_prompts, model_max_tokens

logger = logging.getLogger(__name__)

# OpenAI's default output cap for the legacy completions endpoint.
DEFAULT_MAX_TOKENS = 16


class CompletionLogprobs:
    """The legacy `logprobs` object of one choice: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, start_offset: int) -> None:
        # Character offset of the next token in the choice's text (echoed prompt included).
        self._offset = start_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, positions: list[PositionLogprobs]) -> dict[str, list]:
        """Append positions; return the same four fields for just these (a streaming chunk's)."""
        delta: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for pos in positions:
            # OpenAI: the top N plus the sampled token, so up to N + 1 entries.
            top = {t.token: t.logprob for t in pos.top}
            top.setdefault(pos.sampled.token, pos.sampled.logprob)
            delta["tokens"].append(pos.sampled.token)
            delta["token_logprobs"].append(pos.sampled.logprob)
            delta["top_logprobs"].append(top)
            delta["text_offset"].append(self._offset)
            self._offset += len(pos.sampled.token)
        for key, values in delta.items():
            getattr(self, key).extend(values)
        return delta

    def as_dict(self) -> dict[str, list]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def prompt_logprobs_json(entries: list[list[PromptTokenLogprob] | None]) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the actual token and the top-N."""
    return [
        None if entry is None else {
            str(t.token_id): {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.decoded_token}
            for t in entry
        }
        for entry in entries
    ]


class CompletionServing:
    """Serves /v1/completions on one AsyncEngine."""

    def __init__(self, engine: Any, limits: RequestLimits, prompts: PromptTokenizer, vocab_size: int) -> None:
        self.engine = engine
        # Caps on one request (config).
        self.limits = limits
        # Tokenizes off the event loop.
        self.prompts = prompts
        # Token ids must be below this.
        self.vocab_size = vocab_size

    async def create(self, request: CompletionRequest, arrival_ts: float) -> JSONResponse | EngineStreamResponse:
        check_common(request, self.engine.model_name, self.limits, self.vocab_size)
        prompt_list = request.prompt_list()
        check_completion_prompts(request, prompt_list, self.limits, self.vocab_size)
        await check_response_format(request, self.engine, self.prompts)
        if request.ignored_fields:
            logger.warning("ignoring unknown request fields: %s", ", ".join(request.ignored_fields))
        prompts, prompt_texts = await self.prompts.completion_prompts(prompt_list, request.echo)
        defaults = getattr(self.engine, "generation_defaults", None)
        params = []
        for token_ids in prompts:
            max_tokens = resolve_max_tokens(
                request.max_tokens, model_max_tokens(defaults, DEFAULT_MAX_TOKENS), len(token_ids),
                self.engine.admission_limits, "prompt"
            )
            params.append([request.to_sampling_params(max_tokens, i, defaults) for i in range(request.n)])
        run = ResponseRun.create(self.engine, request, "cmpl", "text_completion", prompts, params, arrival_ts)
        # Per choice: the echoed prompt text ("" without echo), and its logprobs when asked.
        echoes = [prompt_texts[c.spec.prompt_index] if request.echo else "" for c in run.choices]
        logprobs = [CompletionLogprobs(len(e)) if request.logprobs is not None else None for e in echoes]

        wants_prompt_lp = request.prompt_logprobs is not None
        if request.stream:
            return await self._stream(run, echoes, logprobs, wants_prompt_lp)
        return await self._whole(run, echoes, logprobs, wants_prompt_lp)

    @staticmethod
    async def _stream(run: ResponseRun, echoes: list[str], logprobs: list[CompletionLogprobs | None],
                      wants_prompt_lp: bool) -> EngineStreamResponse:
        echoed: set[int] = set()

        def render_delta(choice: ChoiceProgress, out: RequestOutput) -> dict[str, Any] | None:
            index = choice.spec.index
            text = out.new_text
            if index not in echoed and wants_prompt_lp and out.prompt_logprobs is None and not text:
                return None  # the choice's first chunk carries its prompt logprobs (vLLM)
            if index not in echoed:
                echoed.add(index)
                text = echoes[index] + text
            chosen = logprobs[index]
            lp = chosen.add(out.new_logprobs) if chosen is not None and out.new_logprobs else None
            if not text and not lp and out.prompt_logprobs is None:
                return None
            delta = {"index": index, "text": text, "logprobs": lp, "finish_reason": None}
            if out.prompt_logprobs is not None:
                delta["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
            return delta

        def render_finish(choice: ChoiceProgress) -> dict[str, Any]:
            return {"index": choice.spec.index, "text": "", "logprobs": None, "finish_reason": choice.finish_reason}

        return await run.stream_response(render_delta, render_finish)

    @staticmethod
    async def _whole(run: ResponseRun, echoes: list[str], logprobs: list[CompletionLogprobs | None],
                     wants_prompt_lp: bool) -> JSONResponse:
        prompt_lps: list[list[dict[str, dict] | None] | None] = [None] * len(run.choices)

        def on_output(choice: ChoiceProgress, out: RequestOutput) -> None:
            if out.prompt_logprobs is not None:
                prompt_lps[choice.spec.index] = prompt_logprobs_json(out.prompt_logprobs)
            chosen = logprobs[choice.spec.index]
            if chosen is not None and out.new_logprobs:
                chosen.add(out.new_logprobs)

        await run.collect(on_output)
        choices = [
            {
                "index": choice.spec.index,
                "text": echo + choice.text,
                "logprobs": lp.as_dict() if lp is not None else None,
                "finish_reason": choice.finish_reason,
            }
            for choice, echo, lp in zip(run.choices, echoes, logprobs)
        ]
        if wants_prompt_lp:
            for entry, prompt_lp in zip(choices, prompt_lps):
                entry["prompt_logprobs"] = prompt_lp
        return run.whole_response(choices)
