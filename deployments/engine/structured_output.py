"""Structured output: grammars compiled with xgrammar, one matcher per constrained request.

The engine owns this object (the replica process, where the tokenizer lives); workers only ever
see a packed token bitmask per constrained row, carried in the SchedulerOutput and applied by the
sampler (vLLM V1's split: StructuredOutputManager in the engine core, bitmask to the runner).

Compiling: always on the grammar compile threads (GrammarCompilePool: their own pool, each
compile answered within grammar_compile_timeout_s), results kept in a byte-bounded GrammarCache,
one compile per schema at a time however many requests bring it. The HTTP layer compiles when it
validates a request (`compile_async`); the engine loop only looks grammars up (`cached`) and sends
a miss back to the compile threads, so nothing compiles on the event loop.

Per step:
  1. `attach_bitmasks`: for each constrained request that samples this step, the set of tokens
     its grammar allows next (int32 words, bit i of word i // 32 = token i allowed).
  2. the sampler masks every other token to -inf before it filters and samples.
  3. `advance`: the sampled tokens advance the matcher; a token the grammar refuses (it cannot
     happen unless the mask was ignored) ends that request alone.
Any exception inside these hooks is one request's failure: it is reported for that request (the
engine ends it with an error) and the step goes on for the others.

Preemption by recompute keeps the output tokens, so a matcher never has to roll back. The engine
removes a request's matcher when the request ends, however it ends (`remove_request`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deployments.engine.exceptions import GrammarCompileTimeout, StructuredOutputError
from deployments.engine.grammar_cache import GrammarCache
from deployments.engine.grammar_compile_pool import GrammarCompilePool
from scheduler.outputs import SchedulerOutput
from scheduler.request import Request
from scheduler.sampling_params import StructuredOutputSpec

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("tpserve")

# Longest schema (JSON text, characters) accepted for compiling. Compile time and grammar size
# grow with the schema; OpenAI's own structured outputs cap schemas well below this (5,000
# properties, 120,000 characters of names and enum values). The body cap alone (4 MiB) would let
# one request hold a compile thread for a long time.
MAX_SCHEMA_CHARS = 128 * 1024

# What a client reads when a grammar hook raised for its request (the trace is in the log).
GRAMMAR_FAILED_MESSAGE = "the server failed to apply the requested response_format"


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on grammar compiling (crosses config -> engine); defaults are TpserveConfig's."""

    # Seconds from submitting a compile to its answer (queue time included); over it: a 400.
    compile_timeout_s: float = 10.0
    # Bytes of compiled grammars kept for reuse.
    cache_bytes: int = 256 * 1024 * 1024
    # Threads that compile (beside as many that may be stuck in overdue compiles).
    compile_threads: int = 1
    # Longest schema text, in characters.
    max_schema_chars: int = MAX_SCHEMA_CHARS

    @classmethod
    def from_config(cls, config: Any) -> "GrammarLimits":
        return cls(
            compile_timeout_s=config.grammar_compile_timeout_s,
            cache_bytes=config.grammar_cache_bytes,
            compile_threads=config.grammar_compile_threads,
        )


def grammar_error_reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location (clients get the reason, not paths)."""
    return str(exc).split("] ", 1)[-1].split(":", 2)[-1].strip() or type(exc).__name__


class StructuredOutputManager:
    """Compiles grammars (cached, bounded) and keeps one matcher per live constrained request."""

    def __init__(self, tokenizer, vocab_size: int, limits: GrammarLimits | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._tokenizer = tokenizer
        # The model's vocabulary can be padded past the tokenizer's: masks cover the model's.
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self.cache = GrammarCache(self.limits.cache_bytes)
        self.pool = GrammarCompilePool(self.limits.compile_threads, self.limits.compile_timeout_s)
        # xgrammar's compiler: built on first compile, on a compile thread (its tokenizer tables
        # take a moment, and most deployments never constrain output).
        self._compiler = None
        self._compiler_lock = threading.Lock()
        # Guards the in-flight table (the event loop submits, compile threads finish).
        self._lock = threading.Lock()
        # spec -> the Future of its compile, from submission until the compile function returns
        # (past its deadline too): one compile per schema at a time.
        self._inflight: dict[StructuredOutputSpec, Future] = {}
        self._matchers: dict[str, Any] = {}

    def shutdown(self) -> None:
        self.pool.shutdown()

    # ---- compiling --------------------------------------------------------------------
    def cached(self, spec: StructuredOutputSpec) -> Any | None:
        """The compiled grammar if it is ready now (never compiles: safe on the event loop)."""
        return self.cache.get(spec)

    def submit(self, spec: StructuredOutputSpec) -> Future:
        """The Future of `spec`'s grammar, settled within the compile timeout. Raises at once:
        StructuredOutputError for a schema over the size cap or still compiling past its
        deadline, GrammarCompilerBusy when no compile thread is left."""
        if len(spec.json_schema) > self.limits.max_schema_chars:
            raise StructuredOutputError(
                f"the JSON schema has {len(spec.json_schema)} characters; at most "
                f"{self.limits.max_schema_chars} are allowed"
            )
        done: Future = Future()
        grammar = self.cache.get(spec)
        if grammar is not None:
            done.set_result(grammar)
            return done
        with self._lock:
            future = self._inflight.get(spec)
            if future is None:
                future = self._inflight[spec] = self.pool.submit(lambda: self._compile_job(spec))
            elif future.done():
                # Its compile overran and still runs: the same schema would only overrun again.
                raise GrammarCompileTimeout(
                    f"the JSON schema did not compile within grammar_compile_timeout_s="
                    f"{self.limits.compile_timeout_s}s; simplify the schema"
                )
            return future

    def compile(self, spec: StructuredOutputSpec) -> Any:
        """Blocking compile (offline engine, tests): the grammar, or the submit/compile error."""
        return self.submit(spec).result()

    async def compile_async(self, spec: StructuredOutputSpec) -> Any:
        """The grammar, awaited without blocking the loop. A cancelled caller (client gone)
        leaves the compile running for the others waiting on the same schema."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(spec)))

    def _compile_job(self, spec: StructuredOutputSpec) -> Any:
        """On a compile thread: compile, cache (even when its waiters gave up: the next request
        with this schema hits), and leave the in-flight table."""
        try:
            grammar = self._compile_uncached(spec)
            self.cache.put(spec, grammar, grammar.memory_size_bytes)
            return grammar
        finally:
            with self._lock:
                self._inflight.pop(spec, None)

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                info = self._xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size)
                # tpserve's cache replaces xgrammar's (grammar_cache.py says why); one thread per
                # compile: the compile pool's size is the CPU grammars may take.
                self._compiler = self._xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile_uncached(self, spec: StructuredOutputSpec) -> Any:
        compiler = self._get_compiler()
        if spec.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        try:
            json.loads(spec.json_schema)
            # any_whitespace=False: a small model otherwise can pad JSON with whitespace forever.
            return compiler.compile_json_schema(spec.json_schema, any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar raises RuntimeError with a C++ source location first; keep the reason.
            raise StructuredOutputError(
                f"the JSON schema cannot be used for structured output: {grammar_error_reason(exc)}"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - anything else names no reason we can vouch for
            logger.exception("compiling a JSON schema failed")
            raise StructuredOutputError("the JSON schema cannot be used for structured output") from exc

    # ---- per request ------------------------------------------------------------------
    def add_request(self, request_id: str, spec: StructuredOutputSpec, grammar: Any | None = None) -> None:
        """A matcher for the request over `grammar` (None: compile now, blocking - offline only)."""
        self._matchers[request_id] = self._xgr.GrammarMatcher(grammar if grammar is not None else self.compile(spec))

    def remove_request(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def remove_all(self) -> None:
        self._matchers.clear()

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    @property
    def num_constrained(self) -> int:
        return len(self._matchers)

    # ---- per step ---------------------------------------------------------------------
    def make_bitmasks(self, request_ids: list[str],
                      failures: dict[str, str] | None = None) -> "dict[str, torch.Tensor]":
        """Allowed-token bitmask (int32 words) per constrained request about to sample. A request
        whose matcher raises gets no mask and lands in `failures` (request id -> message)."""
        ids = [r for r in request_ids if r in self._matchers]
        if not ids:
            return {}
        masks = self._xgr.allocate_token_bitmask(len(ids), self.vocab_size)
        filled = []
        for row, request_id in enumerate(ids):
            try:
                self._matchers[request_id].fill_next_token_bitmask(masks, row)
                filled.append((row, request_id))
            except Exception:  # noqa: BLE001 - one request's grammar must not end the step
                self._record_failure(failures, request_id, "filling the token bitmask")
        # One clone per row: a view would pickle the whole batch's storage for every rank.
        return {request_id: masks[row].clone() for row, request_id in filled}

    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the matcher; False when the grammar refuses a token (the request must end)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True
        return all(matcher.accept_token(t) for t in token_ids)

    # ---- the engine step's hooks ----------------------------------------------------------
    def attach_bitmasks(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> dict[str, str]:
        """Before execute: mask the rows that sample. Returns the requests whose grammar failed
        (request id -> message): the engine ends them after this step, with an error."""
        failures: dict[str, str] = {}
        if not self._matchers:
            return failures
        sampling = []
        for request_id, n in scheduler_output.num_scheduled_tokens.items():
            if request_id not in self._matchers:
                continue
            try:
                request = requests[request_id]
                # Only a step that completes the known tokens samples (not a partial prefill chunk).
                if request.num_computed_tokens + n >= request.num_tokens:
                    sampling.append(request_id)
            except Exception:  # noqa: BLE001
                self._record_failure(failures, request_id, "selecting the rows to mask")
        try:
            scheduler_output.allowed_token_bitmasks = self.make_bitmasks(sampling, failures)
        except Exception:  # noqa: BLE001 - the batch's mask could not be made: those requests fail, not the step
            for request_id in sampling:
                self._record_failure(failures, request_id, "allocating the token bitmasks")
            scheduler_output.allowed_token_bitmasks = {}
        return failures

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

    @staticmethod
    def _record_failure(failures: dict[str, str] | None, request_id: str, what: str) -> None:
        logger.exception("structured output failed for request %s while %s", request_id, what)
        if failures is not None:
            failures[request_id] = GRAMMAR_FAILED_MESSAGE
