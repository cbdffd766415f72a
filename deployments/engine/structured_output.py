"""Structured output: grammars compiled with xgrammar, one matcher per constrained request.

The engine owns this object (the replica process, where the tokenizer lives); workers only ever
see a packed token bitmask per constrained row, carried in the SchedulerOutput and applied by the
sampler (vLLM V1's split: StructuredOutputManager in the engine core, bitmask to the runner).

Per step:
  1. `make_bitmasks(rows)`: for each constrained request that samples this step, the set of
     tokens its grammar allows next (int32 words, bit i of word i // 32 = token i allowed).
  2. the sampler masks every other token to -inf before it filters and samples.
  3. `accept(request_id, token_ids)`: the sampled tokens advance the matcher; a token the
     grammar refuses (it cannot happen unless the mask was ignored) fails that request alone.

Preemption by recompute keeps the output tokens, so a matcher never has to roll back.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from typing import TYPE_CHECKING

from deployments.engine.exceptions import StructuredOutputError
from scheduler.outputs import SchedulerOutput
from scheduler.request import Request
from scheduler.sampling_params import StructuredOutputSpec

if TYPE_CHECKING:
    import torch

# Compiled grammars kept per (kind, schema): a client that sends the same schema on every request
# (the common case) compiles it once. Bounded: a client sending ever-new schemas cannot grow it.
_GRAMMAR_CACHE_SIZE = 256


class StructuredOutputManager:
    """Compiles grammars (cached) and keeps one matcher per live constrained request."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        # The model's vocabulary can be padded past the tokenizer's: masks cover the model's.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info)
        self._compiled: OrderedDict[StructuredOutputSpec, object] = OrderedDict()
        # HTTP threads validate (compile) while the step thread makes matchers.
        self._lock = threading.Lock()
        self._matchers: dict[str, object] = {}

    # ---- compiling (HTTP edge and engine) ---------------------------------------------
    def compile(self, spec: StructuredOutputSpec) -> object:
        """The compiled grammar for `spec`; StructuredOutputError when it cannot be compiled."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        grammar = self._compile_uncached(spec)
        with self._lock:
            self._compiled[spec] = grammar
            while len(self._compiled) > _GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return grammar

    def _compile_uncached(self, spec: StructuredOutputSpec) -> object:
        if spec.kind == "json_object":
            return self._compiler.compile_builtin_json_grammar()
        try:
            json.loads(spec.json_schema)
            # any_whitespace=False: a small model otherwise can pad JSON with whitespace forever.
            return self._compiler.compile_json_schema(spec.json_schema, any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar raises RuntimeError with a C++ source location first; keep the reason.
            reason = str(exc).split("] ", 1)[-1].split(":", 2)[-1].strip() or type(exc).__name__
            raise StructuredOutputError(f"the JSON schema cannot be used for structured output: {reason}") from exc

    # ---- per request ------------------------------------------------------------------
    def add_request(self, request_id: str, spec: StructuredOutputSpec) -> None:
        self._matchers[request_id] = self._xgr.GrammarMatcher(self.compile(spec))

    def remove_request(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    @property
    def num_constrained(self) -> int:
        return len(self._matchers)

    # ---- per step ---------------------------------------------------------------------
    def make_bitmasks(self, request_ids: list[str]) -> "dict[str, torch.Tensor]":
        """Allowed-token bitmask (int32 words) per constrained request about to sample."""
        ids = [r for r in request_ids if r in self._matchers]
        if not ids:
            return {}
        masks = self._xgr.allocate_token_bitmask(len(ids), self.vocab_size)
        for row, request_id in enumerate(ids):
            self._matchers[request_id].fill_next_token_bitmask(masks, row)
        # One clone per row: a view would pickle the whole batch's storage for every rank.
        return {request_id: masks[row].clone() for row, request_id in enumerate(ids)}

    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the matcher; False when the grammar refuses a token (the request must end)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True
        return all(matcher.accept_token(t) for t in token_ids)

    # ---- the engine step's hooks ----------------------------------------------------------
    def attach_bitmasks(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Before execute: drop matchers of requests that ended, mask the rows that sample."""
        for request_id in scheduler_output.finished_req_ids:
            self._matchers.pop(request_id, None)
        if not self._matchers:
            return
        sampling = [
            request_id for request_id, n in scheduler_output.num_scheduled_tokens.items()
            if request_id in self._matchers
            # Only a step that completes the known tokens samples (not a partial prefill chunk).
            and requests[request_id].num_computed_tokens + n >= requests[request_id].num_tokens
        ]
        scheduler_output.allowed_token_bitmasks = self.make_bitmasks(sampling)

    def advance(self, request: Request, new_token_ids: list[int]) -> str | None:
        """After update: feed the sampled tokens; the reason the request must end, if any."""
        if not new_token_ids or request.request_id not in self._matchers:
            return None
        if not self.accept(request.request_id, new_token_ids):
            return "the sampled output left the requested response_format"
        return None

    def is_finished(self, request_id: str) -> bool:
        """The grammar is complete and has accepted its stop token: nothing more may follow."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()
