"""Greedy tokens for a few rows without reading the whole LM head in bf16 (CPU kernels, one rank).

Why: at one stream a decode step is a read of every weight, and the LM head is a fifth of them
(56.6 MB of the default model's 269 MB in bf16). A greedy row with no logprobs and no logits
processing reads only the argmax of its logits. So for batches of up to `MAX_ROWS` such rows:

1. An int8 copy of the head (one scale per vocabulary row, half the bytes) gives every logit to
   within a bound: |x . W[n] - estimate[n]| <= scale[n] * (||x||_1 * (1/2 + rounding slack) +
   x's rounding to int16 * l1[n]) (workers/cpu/csrc/int8_logits.cpp, which multiplies int16 x by
   the int8 rows in integers).
2. The vocabulary rows whose upper bound reaches the best lower bound, less a margin for the
   final rounding of the logits, are the only ones that can be the argmax. Their 16-row panels
   are computed exactly by the LM head's own kernel on the same packed weight (`panel_linear` on
   its panels, or `amx_linear` on its AMX tiles, whose n blocks are 16 rows too: each output
   depends only on its row of weights and x, so the values are the full head's, bit for bit),
   and the argmax over them, first index on ties, is the full head's argmax.

On the default model's greedy replies the candidates were 4 rows at the median, 39 at p99 and 66
at most of 327 tokens checked (the first pass bounds every logit within ~1 of its value). More
rows, a non-finite hidden state or a wide candidate set fall back to the full head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from workers import load_choices
from workers.cpu import kernels

logger = logging.getLogger(__name__)

# Rows one pass takes (int8_logits.cpp's limit): past two, the pass's arithmetic cost as much as
# the full bf16 head (Zen 4, in an engine: 4 rows 1.07x its step time; measured with the float32
# form the integer one replaced, not since).
MAX_ROWS = 2
# Output features per panel of panel_linear's layouts, and per n block of amx_linear's tiles.
PANEL_ROWS = 16
# K per AMX tile (amx_linear's layout [N/16, ceil(K/32), 16, 32]: each 32-element tile row holds
# one pair of K for each of the block's 16 rows).
TILE_K = 32
# Candidate panels past which the exact pass costs more than it saves (1/8 of the head).
MAX_PANEL_SHARE = 8
# The final logits are rounded to bf16 at most (8 significant bits): two values within 2^-7 of
# the larger one's magnitude may round to the same logit, so candidates reach that far below.
ROUNDING_MARGIN = 2.0**-6


def unpack_panels(packed: torch.Tensor, features: int | None = None) -> torch.Tensor:
    """The [N, K] weight back from a head's small-batch weight: panel_linear's panels [N/16, K, 16]
    or k-pairs [N/16, K/2, 32], or amx_linear's tiles [N/16, ceil(K/32), 16, 32], whose K is
    zero-padded to a multiple of 32 (`features`: the real K, needed for tiles whose K is padded)."""
    groups = packed.size(0)
    if packed.dim() == 4:  # packed[b, kb, p, 2c + e] = W[16b + c, 32kb + 2p + e]
        blocks = packed.size(1)
        weight = packed.view(groups, blocks, TILE_K // 2, PANEL_ROWS, 2).permute(0, 3, 1, 2, 4)
        weight = weight.reshape(groups * PANEL_ROWS, blocks * TILE_K)
    elif packed.size(2) == PANEL_ROWS:
        weight = packed.permute(0, 2, 1).reshape(-1, packed.size(1))
    else:
        pairs = packed.size(1)
        weight = packed.view(groups, pairs, PANEL_ROWS, 2).permute(0, 2, 1, 3).reshape(groups * PANEL_ROWS, 2 * pairs)
    return weight if features is None else weight[:, :features]


@dataclass(frozen=True)
class Int8Rows:
    """An int8 copy of a weight, one scale per row, in groups of G rows by pairs of columns:
    W[n][k] ~ scales[n] * q[n // G, k // 2, n % G, k % 2]."""

    q: torch.Tensor  # [ceil(N / G), ceil(K / 2), G, 2] int8; rows past N and a column past an odd K are zero
    scales: torch.Tensor  # [N] float32: max |W[n]| / 127 (0 for an all-zero row)
    l1: torch.Tensor  # [N] float32: sum of |q[n]|, what x's rounding to int16 costs row n's bound
    features: int  # K

    def row_major(self) -> torch.Tensor:
        """The int8 rows as [N, K]."""
        groups, pairs, group_rows, _ = self.q.shape
        rows = self.q.permute(0, 2, 1, 3).reshape(groups * group_rows, 2 * pairs)
        return rows[: self.scales.numel(), : self.features]


def quantize_rows(weight: torch.Tensor, group_rows: int | None = None, chunk: int = 4096) -> Int8Rows:
    """Each row rounded to int8 at its own scale, max |w| / 127, laid out in groups of
    `group_rows` rows by pairs of columns (None: as the loaded kernels' int8 pass reads them, 64
    rows on AVX-512 and 32 on AVX2, a register's lanes times four)."""
    if group_rows is None:
        group_rows = int(kernels.ops().int8_logits_group_rows())
    rows, features = weight.shape
    groups, pairs = -(-rows // group_rows), -(-features // 2)
    flat = torch.zeros(groups * group_rows, 2 * pairs, dtype=torch.int8)
    scales = torch.empty(rows, dtype=torch.float32)
    for start in range(0, rows, chunk):
        end = min(rows, start + chunk)
        w = weight[start:end].float()
        s = w.abs().amax(dim=1) / 127
        scales[start:end] = s
        flat[start:end, :features] = torch.round(w / torch.where(s > 0, s, 1).unsqueeze(1)).clamp(-127, 127).to(
            torch.int8)
    l1 = flat[:rows].abs().sum(dim=1, dtype=torch.int32).float()
    q = flat.view(groups, group_rows, pairs, 2).permute(0, 2, 1, 3).contiguous()
    return Int8Rows(q, scales, l1, features)


class GreedyLmHead:
    """The int8 copy of an LM head kept on panel_linear's panels or amx_linear's tiles, and the
    two-pass argmax."""

    def __init__(self, packed: torch.Tensor, vocab_size: int, features: int | None = None) -> None:
        weight = unpack_panels(packed, features)
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("the LM head has non-finite weights")
        # The head's panels (or tiles) as its kernel reads them; the exact pass gathers from them.
        self.packed = packed
        # Vocabulary rows past this are padding (not logits).
        self.vocab_size = vocab_size
        # The int8 copy of the vocabulary's rows (padding rows never become candidates, so they
        # cannot set the best lower bound).
        self.rows = quantize_rows(weight[:vocab_size])
        # W's rounding to int8 (1/2 of a scale per element) plus the exact kernel's float32
        # rounding, at most K * 2^-24 of the sum of |products|, as a share of ||x||_1 * 127 *
        # scale (the kernel adds x's rounding to int16 and its own sum's rounding).
        self.slack = 0.5 + weight.size(1) * 2.0**-24 * 127
        # Candidate panels past which argmax() leaves the batch to the full head.
        self.max_panels = max(1, packed.size(0) // MAX_PANEL_SHARE)
        # The most rows argmax() answers.
        self.max_rows = MAX_ROWS

    @staticmethod
    def build(lm_head: torch.nn.Module, vocab_size: int, hidden_size: int, world_size: int) -> GreedyLmHead | None:
        """The greedy head for `lm_head`, or None where it cannot serve: tensor parallelism (the
        logits are gathered across ranks), a head not on panel_linear's panels or amx_linear's
        tiles for every batch of up to MAX_ROWS rows (a plain weight has no 16-row panels to pick
        from), or the kernels not loaded."""
        packed = getattr(lm_head, "small_batch_weight", None)
        if (world_size != 1 or packed is None or packed.dim() not in (3, 4) or lm_head.small_batch_rows < MAX_ROWS
                or kernels.loaded_variant() is None):
            return None
        try:
            return GreedyLmHead(packed, vocab_size, hidden_size)
        except ValueError as exc:
            logger.info(load_choices.GREEDY_HEAD + " off: %s", exc)
            return None

    @property
    def nbytes(self) -> int:
        return self.rows.q.numel() + self.rows.scales.numel() * 4 + self.rows.l1.numel() * 4

    def argmax(self, hidden: torch.Tensor) -> list[int] | None:
        """The full head's greedy token of each row of `hidden` ([M, K], the model's dtype), or
        None where this pass does not answer (the caller runs the full head)."""
        rows = hidden.size(0)
        if rows == 0 or rows > MAX_ROWS:
            return None
        # A non-finite hidden state makes a non-finite bound: no panels, the full head decides.
        # One op: the int8 pass, then the candidate panels exactly by the head's kernel.
        tokens = torch.ops.tpserve_cpu.int8_greedy_tokens(hidden, self.rows.q, self.rows.scales, self.rows.l1,
                                                          self.packed, self.slack, ROUNDING_MARGIN, self.max_panels)
        return tokens.tolist() if tokens.numel() else None
