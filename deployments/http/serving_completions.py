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
from deployments.engine.client import EngineClient
from deployments.engine.outputs import PositionLogprobs, PromptTokenLogprob, RequestOutput
from deployments.http.response_format import check_response_format
from deployments.http.choice_streams import EngineStreamResponse
from deployments.http.prompts import PromptChecks, PromptTokenizer
from deployments.http.protocol import CompletionRequest
from deployments.http.serving_common import ChoiceProgress, ResponseRun
from deployments.http.validation import RequestLimits, check_common, check_completion_prompts, model_max_tokens

logger = logging.getLogger(__name__)

# OpenAI's default output cap for the legacy completions endpoint.
DEFAULT_MAX_TOKENS = 16


class CompletionLogprobs:
    """The legacy `logprobs` object of one choice: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, start_offset: int, num_top: int = 0, echo_first_token: str | None = None) -> None:
        # Character offset of the next token in the choice's text (echoed prompt included).
        self._offset = 0 if echo_first_token is not None else start_offset
        # Where the generated text starts (after the echoed prompt).
        self._generated_offset = start_offset
        # Top alternatives per position (the request's `logprobs`).
        self._num_top = num_top
        # With echo: the prompt's first token (it has no logprob); the prompt's positions then
        # lead the lists, as vLLM does, once its prompt logprobs arrive. None = no echo.
        self._echo_first_token = echo_first_token
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, positions: list[PositionLogprobs],
            prompt: list[list[PromptTokenLogprob] | None] | None = None) -> dict[str, list]:
        """Append positions (after the echoed prompt's, when `prompt` brings them); return the
        same four fields for just these (a streaming chunk's)."""
        delta: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt is not None and self._echo_first_token is not None:
            self._add_prompt(prompt, delta)
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

    def _add_prompt(self, prompt: list[list[PromptTokenLogprob] | None], delta: dict[str, list]) -> None:
        for entry in prompt:
            if entry is None:  # the first prompt token
                token, logprob, top = self._echo_first_token, None, None
            else:
                actual = entry[0]
                token, logprob = actual.decoded_token, actual.logprob
                top = {t.decoded_token: t.logprob for t in entry[1:] if t.rank <= self._num_top}
                top.setdefault(token, logprob)
            delta["tokens"].append(token)
            delta["token_logprobs"].append(logprob)
            delta["top_logprobs"].append(top)
            delta["text_offset"].append(self._offset)
            self._offset += len(token)
        self._offset = self._generated_offset

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

    def __init__(self, engine: EngineClient, limits: RequestLimits, prompts: PromptTokenizer, vocab_size: int) -> None:
        self.engine = engine
        # Caps on one request (config).
        self.limits = limits
        # Tokenizes off the event loop.
        self.prompts = prompts
        # Token ids must be below this.
        self.vocab_size = vocab_size

    async def create(self, request: CompletionRequest, arrival_ts: float) -> JSONResponse | EngineStreamResponse:
        # Cheapest first: fields and prompt sizes, then each prompt's tokens (checked as each is
        # tokenized); the grammar compiles last, for a request that can run.
        check_common(request, self.engine.model_name, self.limits, self.vocab_size)
        prompt_list = request.prompt_list()
        check_completion_prompts(request, prompt_list, self.limits, self.vocab_size)
        if request.ignored_fields:
            logger.warning("ignoring unknown request fields: %s", ", ".join(request.ignored_fields))
        checks = PromptChecks(self.vocab_size, self.engine.admission_limits, self.limits.max_prompt_chars, "prompt")
        prompts, prompt_texts = await self.prompts.completion_prompts(prompt_list, request.echo, checks)
        defaults = getattr(self.engine, "generation_defaults", None)
        params = []
        for token_ids in prompts:
            max_tokens = resolve_max_tokens(
                request.max_tokens, model_max_tokens(defaults, DEFAULT_MAX_TOKENS), len(token_ids),
                self.engine.admission_limits, "prompt"
            )
            params.append([request.to_sampling_params(max_tokens, i, defaults) for i in range(request.n)])
        await check_response_format(request, self.engine)
        firsts = await self._echo_first_tokens(request, prompts)
        run = ResponseRun.create(self.engine, request, "cmpl", "text_completion", prompts, params, arrival_ts)
        # Per choice: the echoed prompt text ("" without echo), and its logprobs when asked.
        echoes = [prompt_texts[c.spec.prompt_index] if request.echo else "" for c in run.choices]
        logprobs = [
            CompletionLogprobs(len(e), request.logprobs, firsts[c.spec.prompt_index] if firsts else None)
            if request.logprobs is not None else None
            for c, e in zip(run.choices, echoes)
        ]
        wants_prompt_lp = request.prompt_logprobs is not None
        if request.stream:
            return await self._stream(run, echoes, logprobs, wants_prompt_lp, firsts is not None)
        return await self._whole(run, echoes, logprobs, wants_prompt_lp)

    async def _echo_first_tokens(self, request: CompletionRequest, prompts: list[list[int]]) -> list[str] | None:
        """Each prompt's first token text when echo lists the prompt's logprobs, else None."""
        if not request.echo or request.logprobs is None:
            return None
        tokenizer = self.prompts.tokenizer
        return await self.prompts.run(lambda: [tokenizer.decode([p[0]]) for p in prompts])

    @staticmethod
    async def _stream(run: ResponseRun, echoes: list[str], logprobs: list[CompletionLogprobs | None],
                      wants_prompt_lp: bool, echoes_logprobs: bool) -> EngineStreamResponse:
        echoed: set[int] = set()
        hold = wants_prompt_lp or echoes_logprobs

        def render_delta(choice: ChoiceProgress, out: RequestOutput) -> dict[str, Any] | None:
            index = choice.spec.index
            text = out.new_text
            if index not in echoed and hold and out.prompt_logprobs is None and not text:
                return None  # the choice's first chunk carries its prompt logprobs (vLLM)
            if index not in echoed:
                echoed.add(index)
                text = echoes[index] + text
            chosen = logprobs[index]
            has_lp = out.new_logprobs or out.prompt_logprobs is not None
            lp = chosen.add(out.new_logprobs or [], out.prompt_logprobs) if chosen is not None and has_lp else None
            sends_prompt_lp = wants_prompt_lp and out.prompt_logprobs is not None
            if not text and not lp and not sends_prompt_lp:
                return None
            delta = {"index": index, "text": text, "logprobs": lp, "finish_reason": None}
            if sends_prompt_lp:
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
            if chosen is not None and (out.new_logprobs or out.prompt_logprobs is not None):
                chosen.add(out.new_logprobs or [], out.prompt_logprobs)

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
