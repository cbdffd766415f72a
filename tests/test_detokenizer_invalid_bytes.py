"""The incremental detokenizer on invalid UTF-8 (a model emitting lone continuation bytes): the
text still equals `tokenizer.decode` of the same ids, and each step decodes a bounded window
instead of re-decoding a run that grows with every token (the default model's byte-level BPE
tokenizer has one token per byte)."""

from __future__ import annotations

import functools
import random

import pytest

from deployments.engine.detokenizer import IncrementalDetokenizer
from scheduler.sampling_params import SamplingParams

PROMPT = "Some context:"


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    from tests.model_fixtures import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


@functools.lru_cache(maxsize=1)
def byte_token_ids() -> dict[int, int]:
    """byte value -> the id of the token that is exactly that byte (GPT-2's byte alphabet:
    printable bytes spell themselves, the others map to chr(256 + k) in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet, extra = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:
            alphabet[b] = chr(256 + extra)
            extra += 1
    tok = tokenizer()
    ids = {b: tok.convert_tokens_to_ids(ch) for b, ch in alphabet.items()}
    # Bytes no text ever holds (0xC0, 0xC1, 0xF5.., some controls) have no token of their own.
    ids = {b: i for b, i in ids.items() if i not in (None, tok.unk_token_id)}
    assert all(b in ids for b in range(0x80, 0xC0)), "every continuation byte has its token"
    return ids


class CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call gets."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.window_sizes: list[int] = []

    def decode(self, ids, **kwargs):
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def stream(ids: list[int], step: int = 1, tok=None) -> tuple[list[str], IncrementalDetokenizer]:
    tok = tok or tokenizer()
    detok = IncrementalDetokenizer(tok, tokenizer().encode(PROMPT), SamplingParams())
    chunks = []
    for start in range(0, len(ids), step):
        detok.add_tokens(ids[start : start + step])
        chunks.append(detok.take_new_text(start + step >= len(ids)))
    return chunks, detok


def lone_continuation_run(n: int) -> list[int]:
    return [byte_token_ids()[0x80 + (k % 64)] for k in range(n)]


@pytest.mark.parametrize("step", [1, 3])
def test_a_long_run_of_continuation_bytes_decodes_a_bounded_window(step):
    tok = tokenizer()
    ids = tok.encode("ok ") + lone_continuation_run(400) + tok.encode(" 語 end")
    counting = CountingTokenizer(tok)
    chunks, detok = stream(ids, step, counting)
    assert "".join(chunks) == detok.text == tok.decode(ids)
    # Without a cap every step re-decodes the whole run held so far (400+ ids by the end).
    assert max(counting.window_sizes) <= 40, max(counting.window_sizes)
    # The run is released while it streams, as decode shows it, not only at the end.
    assert sum("\ufffd" in chunk for chunk in chunks[:-1]) > 10


@pytest.mark.parametrize("tail", ["語", "🙂", "é"])
def test_a_real_character_after_the_run_is_never_split(tail):
    """The tokens kept back at a release may start a real character: it must come out whole."""
    tok = tokenizer()
    char_bytes = [byte_token_ids()[b] for b in tail.encode("utf-8")]
    for run in range(9, 20):
        ids = lone_continuation_run(run) + char_bytes + tok.encode(" x")
        chunks, detok = stream(ids)
        assert "".join(chunks) == detok.text == tok.decode(ids)
        assert tail in detok.text


@pytest.mark.parametrize("seed", range(6))
def test_random_bytes_equal_decode(seed):
    """Any mix of valid and invalid byte sequences: streamed text = decode(ids)."""
    rng = random.Random(seed)
    pool = [b for b in range(0x80, 0x100) if b in byte_token_ids()] + [ord("a"), ord(" ")] + list("語🙂é".encode("utf-8"))
    ids = [byte_token_ids()[rng.choice(pool)] for _ in range(300)]
    for step in (1, 2, 5):
        chunks, detok = stream(ids, step)
        assert "".join(chunks) == detok.text == tokenizer().decode(ids), step
