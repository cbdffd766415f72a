"""From the scheduler's per-request updates to RequestOutputs: detokenization, stop strings,
logprob decoding, and per-request failure isolation.

One object owns every live request's detokenizer. An exception while turning ONE request's
tokens into text or logprobs (a tokenizer fault, a bad id) fails that request alone: it ends
with finish_reason "abort" and an error message, its KV blocks are freed, and the rest of the
batch goes on. The trace goes to the log once; the message says what failed, not where.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from deployments.engine.detokenizer import IncrementalDetokenizer
from deployments.engine.outputs import PositionLogprobs, PromptTokenLogprob, RequestOutput, TokenLogprob
from scheduler.outputs import PromptPositionLogprobs, SampledLogprobs
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import RequestUpdate

logger = logging.getLogger("tpserve")

# Ends requests from outside the step (the scheduler's finish_requests).
FinishRequests = Callable[[list[str], RequestStatus], list[Request]]

# What the client reads when its output could not be produced (the trace is in the log).
OUTPUT_FAILED_MESSAGE = "the server failed to produce this request's output text or logprobs"


class OutputProcessor:
    """Owns the per-request detokenizers and builds every RequestOutput of the engine."""

    def __init__(self, tokenizer, finish_requests: FinishRequests) -> None:
        self.tokenizer = tokenizer
        self._finish_requests = finish_requests
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Request id -> prompt logprobs decoded so far (requests that asked), until delivered.
        self._prompt_logprobs: dict[str, list[list[PromptTokenLogprob] | None]] = {}

    def add_request(self, request: Request) -> None:
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params
        )
        if request.sampling_params.prompt_logprobs is not None:
            self._prompt_logprobs[request.request_id] = [None]  # the first token has none

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._detokenizers

    def process(self, updates: list[RequestUpdate], failures: dict[str, str] | None = None) -> list[RequestOutput]:
        """One output per update; a request whose text reached a stop string is finished here.
        `failures` (request id -> message): requests that failed earlier in the step (their
        grammar hook raised); they end here with that error and without this step's text."""
        outputs = []
        for update in updates:
            message = failures.get(update.request.request_id) if failures else None
            if message is not None:
                outputs.append(self.fail(update.request, message))
                continue
            try:
                outputs.append(self._process_one(update))
            except Exception:  # noqa: BLE001 - one request's fault must not end the batch
                logger.exception("output processing failed for request %s", update.request.request_id)
                outputs.append(self.fail(update.request, OUTPUT_FAILED_MESSAGE))
        return outputs

    def _process_one(self, update: RequestUpdate) -> RequestOutput:
        request = update.request
        detokenizer = self._detokenizers[request.request_id]
        detokenizer.add_tokens(update.new_token_ids)
        if update.new_prompt_logprobs:
            self._add_prompt_logprobs(request.request_id, update.new_prompt_logprobs)
        if detokenizer.stopped_by_string and not request.status.is_finished:
            self._finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        return self.make_output(request, update.new_token_ids, update.new_logprobs)

    def make_output(self, request: Request, new_token_ids: list[int],
                    new_logprobs: list[SampledLogprobs] | None) -> RequestOutput:
        finished = request.status.is_finished
        detokenizer = self._detokenizers.pop(request.request_id) if finished else self._detokenizers[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=list(new_token_ids),
            new_text=detokenizer.take_new_text(finished),
            new_logprobs=self._decode_logprobs(new_logprobs),
            finished=finished,
            finish_reason=request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_prompt_tokens,
            new_events=request.take_events(),
            error=request.error,
            prompt_logprobs=self._take_prompt_logprobs(request, finished),
        )

    def fail(self, request: Request, message: str) -> RequestOutput:
        """End `request` alone with finish_reason "abort" and `message` (frees its KV blocks)."""
        self._finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
        self._detokenizers.pop(request.request_id, None)
        self._prompt_logprobs.pop(request.request_id, None)
        request.error = message
        return RequestOutput.aborted(request.request_id, message, request.num_prompt_tokens,
                                     request.num_output_tokens, request.num_cached_prompt_tokens,
                                     request.take_events())

    def _decode_logprobs(self, logprobs: list[SampledLogprobs] | None) -> list[PositionLogprobs] | None:
        if not logprobs:
            return None
        return [
            PositionLogprobs(self._token_logprob(*position.sampled),
                             [self._token_logprob(tid, value) for tid, value in position.top])
            for position in logprobs
        ]

    def _add_prompt_logprobs(self, request_id: str, positions: list[PromptPositionLogprobs]) -> None:
        """Decode and append the positions not seen yet (a recomputed prompt repeats some)."""
        collected = self._prompt_logprobs.get(request_id)
        if collected is None:
            return
        for position in positions:
            if position.position != len(collected):
                continue
            token_id, logprob, rank = position.actual
            entries = [PromptTokenLogprob(token_id, self.tokenizer.decode([token_id]), logprob, rank)]
            entries += [PromptTokenLogprob(tid, self.tokenizer.decode([tid]), value, n + 1)
                        for n, (tid, value) in enumerate(position.top) if tid != token_id]
            collected.append(entries)

    def _take_prompt_logprobs(self, request: Request, finished: bool) -> list[list[PromptTokenLogprob] | None] | None:
        """The whole list once the prompt is done (first output token) or the request ended."""
        if request.request_id not in self._prompt_logprobs:
            return None
        if request.num_output_tokens == 0 and not finished:
            return None
        return self._prompt_logprobs.pop(request.request_id)

    def _token_logprob(self, token_id: int, logprob: float) -> TokenLogprob:
        return TokenLogprob(token_id, self.tokenizer.decode([token_id]), logprob)
