"""Turn logits into tokens for a batch of requests, on the device, with one host transfer.

    raw logits ─┬─ log-softmax ──────────────────────────────── logprobs (as vLLM / OpenAI report)
                └─ request processors (sampling_penalties) ─┬─ argmax ──────────── greedy rows
                                                            └─ filters ─ draw ──── sampled rows

Greedy rows take one argmax over the batch. Sampled rows draw with the exponential race
(argmax of p / E, E ~ Exp(1)), which is exactly what torch.multinomial does for one sample; a
seeded row's noise comes from its own CPU generator, so its tokens do not depend on batch mates
or device. Token ids, error flags and logprobs come back to the host in ONE transfer.

A row that cannot be sampled (non-finite logits, every token excluded) gets an error instead of
a token; an exception anywhere re-runs the rows one by one so that only the failing request
fails (its request gets the message; the batch goes on).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from scheduler.outputs import SampledLogprobs
from workers.sampling.filters import filtered_probs
from workers.sampling.penalties import apply_request_processors, needs_processing
from workers.sampling.row import SamplingRow

logger = logging.getLogger(__name__)

NON_FINITE_LOGITS = "the model produced non-finite logits for this request"
NOTHING_ALLOWED = ("no token can be sampled: this request's parameters (logit_bias, min_tokens, "
                   "allowed-token mask, temperature) exclude every token")


@dataclass
class SamplerOutput:
    # One token per row; None for a row that failed (its message is in `errors`).
    token_ids: list[int | None]
    # Logprobs per row for rows that asked for them and got a token, else None.
    logprobs: list[SampledLogprobs | None]
    # Row index -> why that row produced no token.
    errors: dict[int, str]


# (values, indices) of every row's max, the first index on ties and at a NaN, as argmax gives.
RowMax = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def torch_row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """max(dim) returns the same (first) index as argmax, NaN included, and was measured 2.7x
    faster on CPU (64 x 49152 floats: 0.8 vs 2.2 ms)."""
    return x.max(dim=-1)


def sample(logits: torch.Tensor, rows: list[SamplingRow], row_max: RowMax = torch_row_max) -> SamplerOutput:
    """logits [R, V], one row per request that samples this step, in the model's dtype: a batch
    that reads more than the argmax of its raw logits is taken to float32 first (argmax_is_enough).
    row_max: every row's max and its first index, from the rank's backend (the CPU kernels have a
    faster one)."""
    if logits.dtype != torch.float32 and not argmax_is_enough(rows):
        logits = logits.float()
    try:
        return _sample_batch(logits, rows, row_max)
    except Exception as exc:  # noqa: BLE001 - isolate the request that caused it
        if len(rows) == 1:
            logger.exception("sampling failed for one request")
            # What failed, not where: the trace is in the log, not in the client's response.
            return SamplerOutput([None], [None], {0: f"sampling failed for this request ({type(exc).__name__})"})
        logger.warning("batched sampling failed (%s); sampling the %d rows one by one", exc, len(rows))
    merged = SamplerOutput([], [], {})
    for i, row in enumerate(rows):
        one = sample(logits[i : i + 1], [row], row_max)
        merged.token_ids.append(one.token_ids[0])
        merged.logprobs.append(one.logprobs[0])
        if 0 in one.errors:
            merged.errors[i] = one.errors[0]
    return merged


def argmax_is_enough(rows: list[SamplingRow]) -> bool:
    """Every row greedy, without logprobs, its logits untouched by processors: then the argmax of
    the raw logits is all the batch reads, which a bf16 / fp16 max gives exactly (widening to
    float32 is exact), so no float32 copy of the logits is made (64 x 49152: 1.5 ms of a ~48 ms
    decode step on a 2-core Xeon)."""
    return all(r.params.is_greedy and r.params.logprobs is None for r in rows) and not needs_processing(rows)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _sample_batch(logits: torch.Tensor, rows: list[SamplingRow], row_max: RowMax) -> SamplerOutput:
    processed = apply_request_processors(logits, rows)
    # The argmax of every row, right for every greedy row, and its value.
    top, token_ids = row_max(processed)
    # No extra pass over the logits: the max lands on a NaN or +inf if the row has one, so the
    # largest value alone says whether the row is finite (-inf entries are harmless masks) and
    # whether any token is left (-inf or NaN: none).
    finite = (top if processed is logits else logits.amax(dim=-1)).isfinite()
    allowed = top > float("-inf")
    sampling = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if sampling:
        drawn, drawn_ok = draw(processed, rows, sampling)
        where = _index(sampling, logits.device)
        token_ids = token_ids.index_copy(0, where, drawn)
        allowed = allowed.index_copy(0, where, allowed[where] & drawn_ok)
    lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    lp_parts, num_top = raw_logprobs(logits, token_ids, rows, lp_rows)
    # The one device -> host transfer of the step (ids are exact in float64).
    parts = [token_ids, finite, allowed, *lp_parts]
    host = torch.cat([p.reshape(-1).to(torch.float64) for p in parts]).tolist()
    return _unpack(host, rows, lp_rows, num_top)


def draw(processed: torch.Tensor, rows: list[SamplingRow], sampling: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sampling row from its filtered distribution, and whether it was defined."""
    device = processed.device
    sub = processed if len(sampling) == processed.shape[0] else processed[_index(sampling, device)]
    probs = filtered_probs(sub, [rows[i].params for i in sampling])
    generators = [rows[i].generator for i in sampling]
    noise = _exponential_noise(probs, generators)
    drawn = (probs / noise).argmax(dim=-1)
    ok = probs.sum(dim=-1) > 0  # False when NaN (softmax of a row with nothing left)
    return drawn, ok


def _exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise like `probs`: a seeded row's from its own (CPU) generator, the others' from
    the device's default generator. Rows are written in place (no stacking copies)."""
    seeded = [n for n, g in enumerate(generators) if g is not None]
    if probs.device.type == "cpu":
        noise = torch.empty_like(probs)
        if not seeded:
            return noise.exponential_()
        for n, generator in enumerate(generators):
            noise[n].exponential_(generator=generator)
        return noise
    # On a device: unseeded rows in one kernel; seeded rows drawn on the CPU, copied once.
    noise = torch.empty_like(probs).exponential_() if len(seeded) < len(generators) else None
    if not seeded:
        return noise
    own = torch.empty(len(seeded), probs.shape[-1])
    for k, n in enumerate(seeded):
        own[k].exponential_(generator=generators[n])
    own = own.to(probs.device, non_blocking=True)
    if noise is None:
        return own
    noise[_index(seeded, probs.device)] = own
    return noise


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow],
                 lp_rows: list[int]) -> tuple[list[torch.Tensor], int]:
    """Log-softmax of the raw logits (before penalties and temperature): the chosen token's
    value per row and the top-N ids and values (N = the largest asked for in the batch)."""
    if not lp_rows:
        return [], 0
    if len(lp_rows) == logits.shape[0]:
        raw, chosen_ids = logits, token_ids
    else:
        where = _index(lp_rows, logits.device)
        raw, chosen_ids = logits[where], token_ids[where]
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, chosen_ids[:, None])
    num_top = max(min(max(rows[i].params.logprobs, 0), logprobs.shape[-1]) for i in lp_rows)
    if num_top == 0:
        return [chosen], 0
    top = torch.topk(logprobs, num_top, dim=-1)
    return [chosen, top.values, top.indices], num_top


def _unpack(host: list[float], rows: list[SamplingRow], lp_rows: list[int], num_top: int) -> SamplerOutput:
    num_rows = len(rows)
    out = SamplerOutput(token_ids=[None] * num_rows, logprobs=[None] * num_rows, errors={})
    for i in range(num_rows):
        if not host[num_rows + i]:
            out.errors[i] = NON_FINITE_LOGITS
        elif not host[2 * num_rows + i]:
            out.errors[i] = NOTHING_ALLOWED
        else:
            out.token_ids[i] = int(host[i])
    chosen_at = 3 * num_rows
    values_at = chosen_at + len(lp_rows)
    ids_at = values_at + len(lp_rows) * num_top
    for n, i in enumerate(lp_rows):
        if out.token_ids[i] is None:
            continue
        wanted = max(rows[i].params.logprobs, 0)
        values = host[values_at + n * num_top : values_at + n * num_top + wanted]
        ids = host[ids_at + n * num_top : ids_at + n * num_top + wanted]
        out.logprobs[i] = SampledLogprobs(
            sampled=(out.token_ids[i], host[chosen_at + n]),
            top=[(int(t), v) for t, v in zip(ids, values)],
        )
    return out
