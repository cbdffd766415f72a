"""The threads that compile grammars: every compile is answered by its deadline, and a compile
nobody waits for any more can hold only a bounded number of threads.

xgrammar compiles in C++ and cannot be interrupted, so a thread running an overdue compile runs
it to its end. The pool does not make anyone wait for that: `timeout_s` after a job is submitted
(queue time included) a watchdog settles its future with GrammarCompileTimeout, whether or not
anyone is waiting on it. An overdue job still queued never runs; an overdue job already running
"abandons" its thread, which stops counting as a serving thread, so a replacement can start and
other schemas keep compiling. When the abandoned compile returns, its thread rejoins the pool if
there is room, else exits.

Bounds: at most `num_threads` serving threads; a new thread starts only while at most
`max_abandoned` are abandoned, so threads alive (serving or abandoned) never exceed
`num_threads + max_abandoned`. With no serving thread left and none allowed to start, `submit`
refuses at once (GrammarCompilerBusy, a 503) instead of queueing work that could only time out.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from deployments.engine.exceptions import GrammarCompileTimeout, GrammarCompilerBusy


class _Job:
    """One submitted compile (pool-internal)."""

    __slots__ = ("future", "fn", "deadline", "running", "abandoned")

    def __init__(self, fn: Callable[[], Any], deadline: float) -> None:
        # Settled once: by the worker with the result, or by the watchdog with a timeout.
        self.future: Future = Future()
        # The compile itself.
        self.fn = fn
        # time.monotonic() after which the job is answered with GrammarCompileTimeout.
        self.deadline = deadline
        # A worker thread has taken it.
        self.running = False
        # It overran while running: its thread no longer counts as serving.
        self.abandoned = False


class GrammarCompilePool:
    """`submit(fn)` runs `fn` on a compile thread; its Future settles within `timeout_s`."""

    def __init__(self, num_threads: int, timeout_s: float, max_abandoned: int | None = None,
                 name: str = "tpserve-grammar") -> None:
        if num_threads < 1:
            raise ValueError("a grammar compile pool needs at least one thread")
        self.num_threads = num_threads
        self.timeout_s = timeout_s
        # Default: as many as serve, so at most twice num_threads threads exist (and compile)
        # whatever clients send.
        self.max_abandoned = num_threads if max_abandoned is None else max_abandoned
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        # Jobs whose future is not settled yet (queued or running): what the watchdog scans.
        self._unsettled: set[_Job] = set()
        self._serving = 0
        self._idle = 0
        self._abandoned = 0
        self._closed = False
        self._watchdog: threading.Thread | None = None

    # ---- introspection (tests, docs) ------------------------------------------------------
    @property
    def num_serving_threads(self) -> int:
        return self._serving

    @property
    def num_abandoned_threads(self) -> int:
        return self._abandoned

    # ---- submitting -----------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue `fn`; GrammarCompilerBusy when no thread could ever take it in time."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compile pool is shut down")
            if self._idle == 0 and self._may_start_thread():
                self._start_thread()
            if self._serving == 0:
                raise GrammarCompilerBusy(
                    f"all grammar compile threads are held by compiles that overran "
                    f"grammar_compile_timeout_s={self.timeout_s}s; retry later"
                )
            job = _Job(fn, time.monotonic() + self.timeout_s)
            self._queue.append(job)
            self._unsettled.add(job)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name=f"{self._name}-watchdog", daemon=True)
                self._watchdog.start()
            self._cond.notify_all()
            return job.future

    def shutdown(self) -> None:
        """Refuse new jobs and fail queued ones; running compiles end on their own (daemon threads)."""
        with self._cond:
            self._closed = True
            for job in self._queue:
                self._settle(job, None, RuntimeError("the grammar compile pool is shut down"))
            self._queue.clear()
            self._cond.notify_all()

    # ---- threads --------------------------------------------------------------------------
    def _may_start_thread(self) -> bool:
        # New threads start only while abandoned ones are within their bound: threads alive
        # never exceed num_threads + max_abandoned.
        return self._serving < self.num_threads and self._abandoned <= self.max_abandoned

    def _start_thread(self) -> None:
        # Daemon: a compile stuck in C++ must not keep the replica process from exiting.
        self._serving += 1
        threading.Thread(target=self._work, name=f"{self._name}-{self._serving + self._abandoned}",
                         daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if not self._queue:  # closed
                    self._serving -= 1
                    return
                job = self._queue.popleft()
                job.running = True
            try:
                result, error = job.fn(), None
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the job
                result, error = None, exc
            with self._cond:
                self._settle(job, result, error)
                if job.abandoned:
                    self._abandoned -= 1
                    if self._serving >= self.num_threads or self._closed:
                        return  # a replacement took this thread's place
                    self._serving += 1  # rejoin

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for job in [j for j in self._unsettled if j.deadline <= now]:
                    self._expire(job)
                next_deadline = min((j.deadline for j in self._unsettled), default=None)
                self._cond.wait(None if next_deadline is None else max(0.0, next_deadline - now))

    def _expire(self, job: _Job) -> None:
        """Called with the lock held, at the job's deadline."""
        self._settle(job, None, GrammarCompileTimeout(
            f"the JSON schema did not compile within grammar_compile_timeout_s={self.timeout_s}s; "
            "simplify the schema"
        ))
        if not job.running:
            self._queue.remove(job)
            return
        # Its thread keeps compiling; it stops counting as serving, so a replacement may start.
        job.abandoned = True
        self._serving -= 1
        self._abandoned += 1
        if self._queue and self._idle == 0 and self._may_start_thread():
            self._start_thread()

    def _settle(self, job: _Job, result: Any, error: BaseException | None) -> None:
        self._unsettled.discard(job)
        if job.future.done():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)
