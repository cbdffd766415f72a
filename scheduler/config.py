"""Scheduler limits (a plain, frozen dataclass shared by the engine and the workers)."""

from __future__ import annotations

from dataclasses import dataclass

# Most requests a GPU replica runs at once when it sizes max_num_seqs itself (vLLM's default on
# H100/H200-class GPUs): the workers derive up to this, and Serve's per-replica cap counts it.
GPU_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class SchedulerConfig:
    # Most requests running at once.
    max_num_seqs: int
    # Per-step token budget (prefill chunks + decode tokens): the most any step takes.
    max_num_batched_tokens: int
    # Longest prompt + output, in tokens.
    max_model_len: int
    # Tokens per KV block.
    block_size: int
    # KV blocks including the null block.
    num_blocks: int
    # Automatic prefix caching.
    enable_prefix_caching: bool = True
    # Window of a model whose every layer slides (Mistral v0.1): blocks behind it are released.
    # None: full attention somewhere (or everywhere), every block is kept.
    sliding_window: int | None = None
    # Budget that grows with the load (see Scheduler.step_token_budget): this many tokens per
    # request in the engine (running + waiting), at least min_num_batched_tokens, at most
    # max_num_batched_tokens (while nothing decodes, the first prompt in line alone may go past it,
    # up to the max: Scheduler._head_prompt_chunk). 0 = every step gets max_num_batched_tokens.
    num_batched_tokens_per_request: int = 0
    # Floor of that budget (ignored where it exceeds max_num_batched_tokens).
    min_num_batched_tokens: int = 0
    # A step that carries decodes takes at most this many times the decodes' own predicted time
    # (Scheduler._prefill_time_budget): prefill chunks are cut to fit. 0 = off.
    max_decode_slowdown: float = 0.0
    # Floor of that step time target, in seconds.
    min_step_time_target_s: float = 0.0
