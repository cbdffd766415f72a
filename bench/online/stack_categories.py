"""Sort py-spy samples of a tpserve replica into the parts of a served token's cost.

Input: py-spy's raw output (`record --threads --idle --full-filenames -f raw`): one line per
distinct stack, "thread (tid): name;frame;frame;... count", root first, each frame
"function (path:line)". Each sample gets the role of its thread (the engine's step thread, the
replica's event loop, tokenizer threads, the rest) and a category from its deepest frame that
says something: our own packages by directory, then the libraries the request path runs through.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<path>.*):\d+\)$")
# Leaf functions of a thread that waits (for work, a lock, a socket): idle, not cost.
_IDLE_LEAVES = ("select", "poll", "epoll", "wait", "_wait", "acquire", "sleep", "get", "_worker",
                "recv", "accept", "read", "readinto", "_recv", "wait_for",
                # A thread whose deepest Python frame is Thread.run is blocked in native code.
                "run")

# (category, path fragments), first match wins, checked from the leaf towards the root.
_OWN = (
    ("sampling", ("/workers/sampler", "/workers/sampling_")),
    ("model forward", ("/workers/",)),
    ("scheduler", ("/scheduler/",)),
    ("output processing + detokenize", ("/deployments/engine/output", "/deployments/engine/detokenizer")),
    ("metrics", ("/metrics/", "/deployments/engine/engine_metrics")),
    ("engine loop (async_engine, streams)", ("/deployments/engine/",)),
    ("HTTP/SSE (tpserve)", ("/deployments/http/",)),
)
_LIBRARIES = (
    ("model forward", ("/torch/",)),
    ("tokenizer", ("/tokenizers/", "/transformers/")),
    ("ASGI server (uvicorn/starlette)", ("/uvicorn/", "/starlette/", "/fastapi/", "/h11/", "/httptools/")),
    ("Ray Serve replica internals", ("/ray/",)),
    ("asyncio", ("/asyncio/",)),
)


def _frames(stack: str) -> list[tuple[str, str]]:
    out = []
    for frame in stack.split(";"):
        m = _FRAME.match(frame)
        out.append((m["func"], m["path"]) if m else (frame, ""))
    return out


def role_of(thread_name: str, frames: list[tuple[str, str]]) -> str:
    if thread_name.startswith("tpserve-step"):
        return "engine step thread"
    if thread_name.startswith("tpserve-tokenize"):
        return "tokenizer threads"
    # The replica's asyncio loop (user code, Serve's router) is not Ray's MainThread, which sits
    # in the core worker's C++ loop.
    if any(f.endswith("run_forever") for f, _ in frames):
        return "asyncio event loops"
    if thread_name == "MainThread":
        return "Ray core worker main thread"
    return "other threads"


def category_of(frames: list[tuple[str, str]]) -> str:
    if not frames or frames[-1][0].split(".")[-1] in _IDLE_LEAVES:
        return "idle (waiting)"
    for table in (_OWN, _LIBRARIES):
        for func, path in reversed(frames):
            if table is _OWN and "site-packages" in path:
                continue  # e.g. ray/_private/workers/ is Ray's, not our workers/
            for category, fragments in table:
                if any(fragment in path for fragment in fragments):
                    return category
    return "other"


def categorize(raw_text: str) -> dict[str, dict[str, float]]:
    """role -> category -> share of that role's samples (0..1), plus "_samples" per role."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for line in raw_text.splitlines():
        head, _, count = line.rpartition(" ")
        if not head.startswith("thread (") or not count.isdigit():
            continue
        thread, _, stack = head.partition(";")
        name = thread.split(": ", 1)[1] if ": " in thread else thread
        frames = _frames(stack) if stack else []
        counts[role_of(name, frames)][category_of(frames)] += int(count)
    out: dict[str, dict[str, float]] = {}
    for role, by_category in counts.items():
        total = sum(by_category.values())
        out[role] = {c: round(n / total, 3) for c, n in by_category.most_common()}
        out[role]["_samples"] = total
    return out


def thread_names(raw_text: str) -> dict[int, str]:
    """OS thread id -> Python thread name, for the threads py-spy saw."""
    names = {}
    for line in raw_text.splitlines():
        m = re.match(r"^thread \((\d+)\): ([^;]*)", line)
        if m:
            names[int(m[1])] = m[2].strip()
    return names
