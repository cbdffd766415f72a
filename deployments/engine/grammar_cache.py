"""Compiled grammars kept for reuse, bounded in bytes (config `grammar_cache_bytes`).

A client that sends the same schema on every request (the common case) compiles it once. The
bound is on what the grammars weigh (xgrammar's `memory_size_bytes`), not on how many there are:
one huge schema must not hold as much room as a thousand small ones. Least recently used go first;
a grammar larger than the whole budget is used but not kept.

tpserve keeps this cache itself rather than xgrammar's (which is turned off): the engine loop must
know, without calling into the compiler, whether a request's grammar is ready - a miss there has
to go to the compile threads, never compile on the event loop - and xgrammar's cache has no
lookup that does not compile on a miss.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from scheduler.sampling_params import StructuredOutputSpec


class GrammarCache:
    """spec -> compiled grammar, least recently used evicted past `limit_bytes`. Thread-safe."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[StructuredOutputSpec, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        # The event loop looks up while compile threads insert.
        self._lock = threading.Lock()

    def get(self, spec: StructuredOutputSpec) -> Any | None:
        with self._lock:
            entry = self._entries.get(spec)
            if entry is None:
                return None
            self._entries.move_to_end(spec)
            return entry[0]

    def put(self, spec: StructuredOutputSpec, grammar: Any, nbytes: int) -> None:
        if nbytes > self.limit_bytes:
            return
        with self._lock:
            old = self._entries.pop(spec, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[spec] = (grammar, nbytes)
            self._bytes += nbytes
            while self._bytes > self.limit_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
