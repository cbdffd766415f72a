"""The incremental detokenizer against `tokenizer.decode` of the same ids (the default model's
byte-level BPE tokenizer: CJK, emoji and accented letters split into several tokens each).

Streaming is simulated exactly as the engine does it: tokens arrive one (or a few) per step and
`take_new_text(finished=False)` releases text after each step; the last call has finished=True.
Whole-response text is `text` at the end. Both must equal the reference.
"""

from __future__ import annotations

import functools

import pytest

from deployments.engine.detokenizer import IncrementalDetokenizer
from scheduler.sampling_params import SamplingParams

TEXTS = {
    "cjk": "日本語のテキストと中文字符，还有한국어도 있습니다。",
    "emoji": "Good 🙂👍🏽 family: 👨‍👩‍👧 flags 🇫🇷 done",
    "accented": "Ça va très bien, naïve façade, Dvořák, Øresund, ſ, İstanbul",
    "code": "def f(x):\n    return {'a': [x**2 for x in range(3)]}  # ≥ 0\n\tprint(\"\\u00e9\")\n",
}
PROMPT = "Some context:"


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    from tests.model_fixtures import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def stream(ids: list[int], params: SamplingParams, step: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `ids` `step` at a time as the engine does; the released chunks and the detokenizer."""
    detok = IncrementalDetokenizer(tokenizer(), tokenizer().encode(PROMPT), params)
    chunks = []
    for start in range(0, len(ids), step):
        detok.add_tokens(ids[start : start + step])
        finished = detok.stopped_by_string or start + step >= len(ids)
        chunks.append(detok.take_new_text(finished))
        if detok.stopped_by_string:
            break
    return chunks, detok


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("name", list(TEXTS))
def test_streamed_and_whole_text_equal_decode(name, step):
    ids = tokenizer().encode(TEXTS[name])
    assert any("\ufffd" in tokenizer().decode([i]) for i in ids) or name == "code"
    chunks, detok = stream(ids, SamplingParams(), step)
    assert "".join(chunks) == detok.text == tokenizer().decode(ids) == TEXTS[name]
    # A character split across tokens is never released half (no replacement character).
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_an_unfinished_character_at_the_end_is_released_as_decode_shows_it():
    ids = tokenizer().encode("語")
    assert len(ids) > 1
    cut = ids[:-1]  # the generation ended (max_tokens) inside the character
    chunks, detok = stream(cut, SamplingParams())
    assert "".join(chunks) == detok.text == tokenizer().decode(cut)


def _boundary_stop(ids: list[int]) -> str:
    """A stop string made of the end of one token and the start of the next (both visible)."""
    pieces = [tokenizer().decode([i]) for i in ids]
    for k in range(len(pieces) // 2, len(pieces) - 1):
        left, right = pieces[k].strip(), pieces[k + 1]
        if left.isalpha() and right[:1].isalpha() and "\ufffd" not in left + right:
            return pieces[k][-2:] + right[:2]
    raise AssertionError("no boundary between two visible tokens")


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("where", ["across_tokens", "at_the_end", "multibyte", "multibyte_emoji"])
def test_stop_strings_streamed_equal_whole(where, step):
    text = {"across_tokens": TEXTS["accented"], "at_the_end": TEXTS["accented"],
            "multibyte": TEXTS["cjk"], "multibyte_emoji": TEXTS["emoji"]}[where]
    ids = tokenizer().encode(text)
    stop = {"at_the_end": text[-3:], "multibyte": "字符", "multibyte_emoji": "👍🏽"}.get(where) or _boundary_stop(ids)
    assert text.index(stop) > 0
    chunks, detok = stream(ids, SamplingParams(stop=(stop, "never there")), step)
    expected = text[: text.index(stop)]
    assert detok.stopped_by_string
    assert "".join(chunks) == detok.text == expected
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_a_stop_string_never_matches_half_a_character():
    """The replacement character an incomplete byte sequence decodes to is never text."""
    ids = tokenizer().encode(TEXTS["cjk"])
    chunks, detok = stream(ids, SamplingParams(stop=("\ufffd",)))
    assert not detok.stopped_by_string and "".join(chunks) == TEXTS["cjk"]


def test_text_held_back_for_a_possible_stop_is_released_when_no_stop_comes():
    ids = tokenizer().encode(TEXTS["accented"])
    chunks, detok = stream(ids, SamplingParams(stop=("bien, naïve X",)))
    assert not detok.stopped_by_string and "".join(chunks) == TEXTS["accented"]
    # While streaming, the possible start of the stop string was held back, not dropped.
    assert chunks[-1], "the held-back tail must come out with the final chunk"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_as_transformers(skip):
    tok = tokenizer()
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = tok.encode("Hello there") + [im_end] + tok.encode("\nnaïve 日本") + [im_start, im_end]
    chunks, detok = stream(ids, SamplingParams(skip_special_tokens=skip))
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(chunks) == detok.text == expected
    assert ("<|im_end|>" in expected) is not skip


def test_a_stop_string_completed_by_the_first_character_of_a_new_token():
    """The longest stop string, all but its last character already released-or-held: the search
    must start exactly len(stop) - 1 characters back (one later misses it)."""
    tok = tokenizer()
    text = TEXTS["accented"]
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    k = next(k for k in range(1, len(pieces) - 1)
             if len(pieces[k]) >= 3 and pieces[k + 1][:1].strip() and "\ufffd" not in pieces[k] + pieces[k + 1])
    stop = pieces[k][-3:] + pieces[k + 1][0]
    start = len(tok.decode(ids[: k + 1])) - 3
    assert text.index(stop) == start
    chunks, detok = stream(ids, SamplingParams(stop=(stop,)))
    assert detok.stopped_by_string and "".join(chunks) == detok.text == text[:start]
