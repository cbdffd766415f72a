"""Prompt prefixes as short chained digests: what the router matches and replicas publish.

A prompt's routing text is cut into fixed-size character chunks; digest i covers chunks 0..i
(each digest chains the previous one), so two prompts share their first k digests exactly when
their first k chunks are equal. Characters, not tokens: the router never loads a tokenizer, and
equal text prefixes tokenize to (almost) equal token prefixes, which is what the engine's prefix
cache reuses. Pure Python, no Ray.
"""

from __future__ import annotations

import hashlib
from typing import Any

# Characters per chunk: about 16 tokens of English text (one KV block at block_size 16).
CHUNK_CHARS = 64
# Most digests per prompt: prefixes beyond 64 x 64 = 4096 characters do not change a decision.
MAX_DIGESTS = 64


def routing_text(body: Any) -> str:
    """The text a request's prompt starts with: the completions `prompt` (first one if a list),
    or the chat `messages` as role/content lines (the chat template keeps their order). Anything
    else (a malformed body) gives "", which routes by load alone."""
    if not isinstance(body, dict):
        return ""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages if isinstance(m, dict))
    return ""


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    if not isinstance(content, str):
        content = ""
    return f"<{message.get('role')}>{content}\n"


def prefix_digests(text: str, chunk_chars: int = CHUNK_CHARS, max_digests: int = MAX_DIGESTS) -> list[int]:
    """Chained 64-bit digests of the whole chunks of `text` (a partial last chunk is left out:
    the engine only reuses whole KV blocks)."""
    digests: list[int] = []
    previous = b""
    for start in range(0, min(len(text), chunk_chars * max_digests) - chunk_chars + 1, chunk_chars):
        chunk = text[start:start + chunk_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + chunk, digest_size=8).digest()
        digests.append(int.from_bytes(previous, "big", signed=True))
    return digests


def matched_prefix_len(digests: list[int], held: set[int] | frozenset[int]) -> int:
    """How many leading digests of a prompt a replica holds (chaining makes the count exact)."""
    count = 0
    for digest in digests:
        if digest not in held:
            break
        count += 1
    return count
