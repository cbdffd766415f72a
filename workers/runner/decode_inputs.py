"""The decode input layout, one for the CPU runner and the CUDA-graph runner.

A decode step feeds every request the first token whose K/V are not cached yet. Per request it
needs five things: that token, its position, the KV slot it is written to, the block table of
its context and the context length (this token included). `make_decode_batch` derives them
(the one place the slot and block-table arithmetic lives); `pad_decode_batch` appends rows that
read and write only the null block (NULL_BLOCK_ID); `DecodeInputBuffers` holds them on the
device at fixed addresses, refilled in place each step from pinned host mirrors with one
non-blocking copy per tensor.

Why pinned mirrors are safe to reuse: a step's copies are queued before its forward, and the
sampler reads the sampled tokens back to the host (a sync) before the next step fills the
mirrors again, so no copy is still reading a mirror when it is overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from scheduler.block_pool import NULL_BLOCK_ID


def slot_of(block_ids: list[int], position: int, block_size: int) -> int:
    """The flat KV slot of a token: its block's id * block_size + its offset in the block."""
    return block_ids[position // block_size] * block_size + position % block_size


@dataclass
class DecodeBatch:
    """Host-side inputs of a decode-only step, one row per request (padding rows included)."""

    # The token each request feeds this step.
    token_ids: list[int]
    # Its position in the sequence.
    positions: list[int]
    # The KV slot it is written to (slot_of).
    slots: list[int]
    # Block ids covering each request's context, in token order (unpadded rows). Token rows of
    # one prefill chunk share one list, the chunk's blocks (ModelRunner._run_rows): a row may
    # then hold blocks past its context, which the kernels, reading context_lens, never touch.
    block_tables: list[list[int]]
    # Context length of each request, this step's token included.
    context_lens: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.token_ids)

    @property
    def max_num_blocks(self) -> int:
        return max((len(t) for t in self.block_tables), default=0)


def make_decode_batch(requests: list[tuple[list[int], list[int], int]], block_size: int) -> DecodeBatch:
    """From (token_ids, block_ids, num_computed_tokens) per request: feed token num_computed."""
    batch = DecodeBatch([], [], [], [], [])
    for token_ids, block_ids, num_computed in requests:
        pos = num_computed
        batch.token_ids.append(token_ids[pos])
        batch.positions.append(pos)
        batch.slots.append(slot_of(block_ids, pos, block_size))
        batch.block_tables.append(block_ids[: pos // block_size + 1])
        batch.context_lens.append(pos + 1)
    return batch


def pad_decode_batch(batch: DecodeBatch, size: int, block_size: int) -> DecodeBatch:
    """Append size - num_reqs dummy requests (token 0 at position 0, context length 1) that read
    and write only the first slot of the null block."""
    pad = size - batch.num_reqs
    if pad < 0:
        raise ValueError(f"cannot pad a batch of {batch.num_reqs} down to {size}")
    return DecodeBatch(
        token_ids=batch.token_ids + [0] * pad,
        positions=batch.positions + [0] * pad,
        slots=batch.slots + [NULL_BLOCK_ID * block_size] * pad,
        block_tables=batch.block_tables + [[NULL_BLOCK_ID]] * pad,
        context_lens=batch.context_lens + [1] * pad,
    )


def padded_block_tables(block_tables: list[list[int]], width: int) -> list[list[int]]:
    """Rows padded with the null block to `width` entries."""
    return [row + [NULL_BLOCK_ID] * (width - len(row)) for row in block_tables]


def decode_mask(context_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, 1, 1, width] True where a key position lies inside the request's context."""
    positions = torch.arange(width, device=context_lens.device)
    return (positions[None, :] < context_lens[:, None])[:, None, None, :]


@dataclass
class DecodeInputBuffers:
    """Every tensor a decode forward reads; a forward (and a captured graph) sees views of the
    leading rows. Entries of a block-table row past the step's widest row keep whatever an earlier
    step wrote there (always a valid block id): kernels never read past a context unmasked."""

    # [max_batch] long: the token fed to each request.
    input_ids: torch.Tensor
    # [max_batch] long: its position.
    positions: torch.Tensor
    # [max_batch] long: the KV slot its K/V are written to.
    slot_mapping: torch.Tensor
    # [max_batch, max_blocks] int32: block tables, padded with NULL_BLOCK_ID.
    block_tables: torch.Tensor
    # [max_batch] int32: context lengths (this step's token included).
    context_lens: torch.Tensor
    # Host mirrors of the five tensors above (pinned when the device is CUDA): flat, so the rows
    # of a step are one contiguous run.
    staging: dict[str, torch.Tensor]

    @classmethod
    def make(cls, max_batch: int, max_blocks: int, device: torch.device) -> "DecodeInputBuffers":
        long = dict(dtype=torch.long, device=device)
        int32 = dict(dtype=torch.int32, device=device)
        tensors = dict(
            input_ids=torch.zeros(max_batch, **long),
            positions=torch.zeros(max_batch, **long),
            slot_mapping=torch.full((max_batch,), NULL_BLOCK_ID, **long),
            block_tables=torch.full((max_batch, max_blocks), NULL_BLOCK_ID, **int32),
            context_lens=torch.ones(max_batch, **int32),
        )
        pin = device.type == "cuda"
        staging = {name: torch.empty(t.numel(), dtype=t.dtype, pin_memory=pin) for name, t in tensors.items()}
        return cls(**tensors, staging=staging)

    def fill(self, batch: DecodeBatch, num_blocks: int) -> None:
        """Write a (padded) batch into the leading rows; no host sync. Block-table rows are
        written up to the batch's widest row (null-padded), which must fit num_blocks."""
        n, width = batch.num_reqs, batch.max_num_blocks
        if width > num_blocks:
            raise ValueError(f"a request needs {width} blocks; the table is {num_blocks} wide")
        host = {name: t.numpy() for name, t in self.staging.items()}
        host["input_ids"][:n] = batch.token_ids
        host["positions"][:n] = batch.positions
        host["slot_mapping"][:n] = batch.slots
        host["context_lens"][:n] = batch.context_lens
        tables = host["block_tables"][: n * width].reshape(n, width)
        tables.fill(NULL_BLOCK_ID)
        # Consecutive rows holding the same list (a prefill chunk's token rows) are written in
        # one broadcast assignment.
        run_start = 0
        for i in range(1, n + 1):
            if i == n or batch.block_tables[i] is not batch.block_tables[run_start]:
                ids = batch.block_tables[run_start]
                tables[run_start:i, : len(ids)] = ids
                run_start = i
        for f in fields(self):
            if f.name == "staging":
                continue
            device = getattr(self, f.name)
            if f.name == "block_tables":
                source = self.staging[f.name][: n * width].view(n, width)
                device[:n, :width].copy_(source, non_blocking=True)
            else:
                device[:n].copy_(self.staging[f.name][:n], non_blocking=True)

