"""Temperature, top-k, top-p and min-p over a batch of rows, each row with its own values.

Each filter follows the transformers warper of the same name (TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper), tie rules included, in the order
`generate` applies them; removed tokens get -inf. A filter runs only on the rows that use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from scheduler.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype).to(like.device, non_blocking=True)[:, None]


def _apply_to(logits: torch.Tensor, picked: list[int], fn) -> torch.Tensor:
    """fn on the picked rows only (all rows without a gather when every row is picked)."""
    if len(picked) == logits.shape[0]:
        return fn(logits)
    where = torch.tensor(picked, dtype=torch.long).to(logits.device, non_blocking=True)
    logits = logits.clone()
    logits[where] = fn(logits[where])
    return logits


def apply_temperature(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits / temperature; an overflow (a huge logit over a tiny temperature) saturates at the
    largest float rather than becoming inf, so softmax stays defined."""
    scaled = logits / _column([p.temperature for p in params], logits)
    return torch.nan_to_num_(scaled, nan=_NEG_INF, posinf=torch.finfo(logits.dtype).max, neginf=_NEG_INF)


def apply_top_k(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Keep tokens at least as likely as the k-th (ties with the k-th are kept, as in HF)."""
    vocab = logits.shape[-1]
    picked = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if not picked:
        return logits
    ks = [params[i].top_k for i in picked]

    def top_k(rows: torch.Tensor) -> torch.Tensor:
        top_values = torch.topk(rows, max(ks), dim=-1).values
        k_index = torch.tensor(ks).to(rows.device, non_blocking=True)[:, None] - 1  # no blocking copy
        kth = top_values.gather(1, k_index)
        return rows.masked_fill(rows < kth, _NEG_INF)

    return _apply_to(logits, picked, top_k)


def apply_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Nucleus: ascending sort, drop tokens whose cumulative mass (with every less likely token)
    is at most 1 - top_p, always keep the most likely token: HF's rule, ties ordered by sort."""
    picked = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if not picked:
        return logits
    drop_mass = [1.0 - params[i].top_p for i in picked]

    def top_p(rows: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = torch.sort(rows, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= _column(drop_mass, rows)
        remove[:, -1] = False
        return rows.masked_fill(remove.scatter(1, order, remove), _NEG_INF)

    return _apply_to(logits, picked, top_p)


def apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Drop tokens less likely than min_p x the most likely token's probability."""
    picked = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if not picked:
        return logits
    min_ps = [min(params[i].min_p, 1.0) for i in picked]  # > 1 would drop even the top token

    def min_p(rows: torch.Tensor) -> torch.Tensor:
        probs = rows.softmax(dim=-1)
        threshold = _column(min_ps, rows) * probs.amax(dim=-1, keepdim=True)
        return rows.masked_fill(probs < threshold, _NEG_INF)

    return _apply_to(logits, picked, min_p)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Processed logits [S, V] of sampling rows -> the distribution each row samples from."""
    logits = apply_temperature(logits, params)
    logits = apply_top_k(logits, params)
    logits = apply_top_p(logits, params)
    logits = apply_min_p(logits, params)
    return logits.softmax(dim=-1)
