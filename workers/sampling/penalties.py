"""Logits processors that depend on a request's tokens or its own rules, batched over rows.

Applied in this order (vLLM's and OpenAI's): repetition penalty (HF's rule, over prompt and
output), frequency and presence penalties (over the output), `logit_bias`, the min_tokens mask
on stop ids, and the allowed-token bitmask. Every function edits `logits` [R, V] in place and
ignores token ids outside the vocabulary, so a bad id fails nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
import torch

from workers.sampling.row import SamplingRow


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _device_scalar(value: float | bool, like: torch.Tensor) -> torch.Tensor:
    """`value` made on like's device by a fill kernel. `t[idx] = value` would copy a host scalar
    with a blocking transfer: on an H200 each one was a host sync beside the step's one."""
    return torch.full((), value, dtype=like.dtype, device=like.device)


def _pairs(rows: Sequence[SamplingRow], picked: list[int], ids_of, vocab: int) -> tuple[list[int], list[int]]:
    """(position in `picked`, token id) for every in-vocabulary id of every picked row."""
    row_index: list[int] = []
    token_index: list[int] = []
    for n, i in enumerate(picked):
        ids = [t for t in ids_of(rows[i]) if 0 <= t < vocab]
        row_index.extend([n] * len(ids))
        token_index.extend(ids)
    return row_index, token_index


def apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """HF's RepetitionPenaltyLogitsProcessor: a seen token's logit is divided by the penalty
    when positive, multiplied by it otherwise (seen = in the prompt or the output)."""
    picked = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not picked:
        return
    device, vocab = logits.device, logits.shape[-1]
    row_index, token_index = _pairs(rows, picked, lambda r: set(r.prompt_token_ids) | set(r.output_token_ids), vocab)
    seen = torch.zeros(len(picked), vocab, dtype=torch.bool, device=device)
    seen.index_put_((_index(row_index, device), _index(token_index, device)), _device_scalar(True, seen))
    where = _index(picked, device)
    penalty = torch.tensor([rows[i].params.repetition_penalty for i in picked], dtype=logits.dtype)
    penalty = penalty.to(device, non_blocking=True)[:, None]
    values = logits[where]
    penalized = torch.where(values > 0, values / penalty, values * penalty)
    logits[where] = torch.where(seen, penalized, values)


def apply_frequency_presence(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """OpenAI's penalties over generated tokens: frequency x count + presence x (count > 0)."""
    picked = [i for i, r in enumerate(rows)
              if r.output_token_ids and (r.params.frequency_penalty or r.params.presence_penalty)]
    if not picked:
        return
    device, vocab = logits.device, logits.shape[-1]
    row_index, token_index = _pairs(rows, picked, lambda r: r.output_token_ids, vocab)
    counts = torch.zeros(len(picked), vocab, dtype=logits.dtype, device=device)
    ones = torch.ones(len(token_index), dtype=logits.dtype, device=device)
    counts.index_put_((_index(row_index, device), _index(token_index, device)), ones, accumulate=True)
    frequency = torch.tensor([rows[i].params.frequency_penalty for i in picked], dtype=logits.dtype)
    presence = torch.tensor([rows[i].params.presence_penalty for i in picked], dtype=logits.dtype)
    where = _index(picked, device)
    values = logits[where]
    values -= frequency.to(device, non_blocking=True)[:, None] * counts
    values -= presence.to(device, non_blocking=True)[:, None] * (counts > 0).to(logits.dtype)
    logits[where] = values


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """OpenAI's logit_bias: a per-token value added to the (penalized) logit."""
    vocab = logits.shape[-1]
    row_index: list[int] = []
    token_index: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias:
            if 0 <= token_id < vocab:
                row_index.append(i)
                token_index.append(token_id)
                biases.append(bias)
    if not biases:
        return
    device = logits.device
    values = torch.tensor(biases, dtype=logits.dtype).to(device, non_blocking=True)
    logits.index_put_((_index(row_index, device), _index(token_index, device)), values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Stop ids (EOS + stop_token_ids) get -inf while a request is under its min_tokens."""
    picked = [i for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens and r.stop_ids]
    if not picked:
        return
    row_index, token_index = _pairs(rows, picked, lambda r: r.stop_ids, logits.shape[-1])
    rows_in_batch = [picked[n] for n in row_index]
    logits.index_put_((_index(rows_in_batch, logits.device), _index(token_index, logits.device)),
                      _device_scalar(float("-inf"), logits))


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 words [R, ceil(V/32)] -> allowed [R, V] bool, xgrammar's layout: token t is allowed
    when bit t % 32 of word t // 32 is set. Tokens beyond the words are not allowed."""
    token = torch.arange(vocab, device=words.device)
    word_index = token // 32
    in_range = word_index < words.shape[-1]
    picked = words[:, word_index.clamp(max=words.shape[-1] - 1)]
    return ((picked >> (token % 32)) & 1).bool() & in_range


def apply_allowed_bitmask(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Tokens a request's allowed-token bitmask (structured output) leaves out get -inf."""
    picked = [i for i, r in enumerate(rows) if r.allowed_token_bitmask is not None]
    if not picked:
        return
    masks = [torch.as_tensor(rows[i].allowed_token_bitmask).reshape(-1).to(torch.int64) for i in picked]
    width = max(m.numel() for m in masks)
    padded = torch.stack([torch.nn.functional.pad(m, (0, width - m.numel())) for m in masks])
    # int64 first: words written as unsigned 32-bit values keep their bits.
    words = padded.to(logits.device, non_blocking=True) & 0xFFFFFFFF
    allowed = unpack_bitmask(words, logits.shape[-1])
    where = _index(picked, logits.device)
    logits[where] = logits[where].masked_fill(~allowed, float("-inf"))


def apply_request_processors(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Every processor above, on a copy when any row needs one (else `logits` itself).

    Extreme parameters (a repetition penalty near 0) can overflow a logit; +inf becomes the
    largest float and NaN becomes -inf so that softmax and argmax stay defined for the row.
    """
    if not needs_processing(rows):
        return logits
    logits = logits.clone()
    apply_repetition_penalty(logits, rows)
    apply_frequency_presence(logits, rows)
    apply_logit_bias(logits, rows)
    apply_min_tokens(logits, rows)
    apply_allowed_bitmask(logits, rows)
    return torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max,
                             neginf=float("-inf"))


def needs_processing(rows: Sequence[SamplingRow]) -> bool:
    """Whether any row's logits are changed by a processor above."""
    return any(_needs_processing(r) for r in rows)


def _needs_processing(row: SamplingRow) -> bool:
    return (row.params.needs_penalties or bool(row.params.logit_bias) or row.allowed_token_bitmask is not None
            or len(row.output_token_ids) < row.params.min_tokens)
