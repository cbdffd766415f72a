"""Incremental detokenization that never emits broken UTF-8 and holds back possible stop strings."""

from __future__ import annotations

from scheduler.sampling_params import SamplingParams

# Prompt tokens decoded with the output so that the first output token keeps its leading space
# (SentencePiece tokenizers drop it at the start of a decode).
_PROMPT_CONTEXT_TOKENS = 5

# Tokens held back while the text ends in an incomplete character. One UTF-8 character is at most
# 4 bytes and every byte token at least one, so a character still incomplete after this many
# tokens never will be: the run is invalid bytes (a model emitting lone continuation bytes). Past
# it, the held tokens are released as decode shows them (U+FFFD), all but the last
# _HELD_TOKENS_KEPT, which could still start a real character - so each step decodes a window
# of at most _MAX_HELD_TOKENS + a few tokens instead of a window growing with the run.
_MAX_HELD_TOKENS = 8
# Enough to hold the 3 bytes that can follow a character's first byte: every sequence that
# started before the split is then decided by bytes already seen, and the split never changes
# what decode(all ids) shows.
_HELD_TOKENS_KEPT = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # The whole output text so far (stop-string truncation applied).
        self.text = ""
        self._num_released = 0
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self.stopped_by_string = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> None:
        """Append tokens; sets `stopped_by_string` when a stop string appears in the text."""
        if self.stopped_by_string:
            return
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        # A trailing U+FFFD means a multi-byte character is still incomplete: wait for more.
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            if len(self._ids) - self._read_offset > _MAX_HELD_TOKENS:
                self._release_invalid_run(prefix_text, full_text)
            return
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._append(full_text[len(prefix_text) :])

    def _release_invalid_run(self, prefix_text: str, full_text: str) -> None:
        """Release the held tokens but the last few, as decode shows them, when that text is
        what decoding them together with the kept ones shows too (else hold on: the window is
        still bounded by what a character can span)."""
        split = len(self._ids) - _HELD_TOKENS_KEPT
        released_text = self._decode(self._ids[self._prefix_offset : split])
        if len(released_text) <= len(prefix_text) or not full_text.startswith(released_text):
            return
        self._prefix_offset = self._read_offset
        self._read_offset = split
        self._append(released_text[len(prefix_text) :])

    def _append(self, delta: str) -> None:
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        if self.params.stop:
            self._check_stop_strings(search_from)

    def _flush(self) -> None:
        """At the end, tokens still held for an incomplete character are released as
        tokenizer.decode shows them (U+FFFD included): the text is then decode(output ids)."""
        if self.stopped_by_string or self._read_offset == len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        if len(full_text) > len(prefix_text):
            self._append(full_text[len(prefix_text) :])

    def _check_stop_strings(self, search_from: int) -> None:
        first = -1
        for stop in self.params.stop:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (first == -1 or idx < first):
                first = idx
        if first != -1:
            self.text = self.text[:first]  # OpenAI excludes the stop string itself
            self.stopped_by_string = True

    def take_new_text(self, finished: bool) -> str:
        """Text not yet released; the tail that could still start a stop string is held back."""
        if finished:
            self._flush()
        end = len(self.text)
        if not finished and not self.stopped_by_string and self._max_stop_len > 1:
            end = max(self._num_released, end - (self._max_stop_len - 1))
        new_text = self.text[self._num_released : end]
        self._num_released = end
        return new_text
