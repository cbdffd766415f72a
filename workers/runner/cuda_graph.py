"""CUDA-graph decode: the decode-only forward captured once per (batch size, context width).

On GPUs a decode step of a small batch is bound by kernel launches (~15 per layer); replaying a
captured graph launches them all at once. The runner owns:
  * static input buffers (workers/runner/decode_inputs.py: token ids, positions, slot mapping, block
    tables, context lengths, refilled from pinned host mirrors) that every graph reads, and each
    graph's static output;
  * the capture list: batch sizes 1, 2, 4, 8, then steps of 8 up to
    min(max_num_seqs, max_cuda_graph_batch_size), times the attention backend's block-table
    widths (one for the Triton kernel, which reads only the blocks a request holds; several for
    the torch reference, whose gather grows with the width); captured largest first on one
    shared memory pool (smaller graphs reuse its memory);
  * `can_use(batch)`: a decode-only batch no larger than the largest captured size. Such a batch
    is padded to the next captured size with dummy requests (token 0 at position 0, their one
    K/V slot and every block-table entry in the null block, context length 1) and replayed.
  * token rows (`can_replay_rows`): with a backend that reads blocks in place (Triton), steps
    that carry prefill tokens replay graphs too. Every scheduled token is one row, fed like a
    decode: a prompt token at position p attends to the p + 1 tokens up to itself, which is
    causal attention by construction, since the whole chunk's K/V are written before any row
    reads. The capture list then goes on past the decode sizes up to max_graph_tokens. Measured
    on an H200 before this: every step with a prefill chunk ran eagerly at ~17 ms against
    2.6-5 ms for a graphed decode step, whatever its size. Steps whose prefill rows read more
    context than MAX_TOKEN_ROW_CONTEXT_READS stay eager (long prompts: see there).
A step too large for every graph, a mixed step with another backend, and every step under
`enforce_eager` run eagerly (the model runner's flat path, or this runner's eager decode).

The pure functions below (sizes, bucket choice, the step plan; padding is in decode_inputs) hold all the decisions and
are tested on CPU; `capture` takes a capturer object so that CPU tests can stand in for CUDA.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from workers.attention.paged import AttentionMetadata
from workers.runner.decode_inputs import DecodeBatch, DecodeInputBuffers, pad_decode_batch
from workers.attention.graph_decode import DecodeAttention, DecodeAttentionBackend
from scheduler.math_utils import cdiv

logger = logging.getLogger(__name__)

MiB = 1 << 20


# ---- pure decisions ----------------------------------------------------------------------
def make_capture_sizes(max_num_seqs: int, max_cuda_graph_batch_size: int, max_graph_tokens: int = 0) -> list[int]:
    """Decode batches: 1, 2, 4, 8, then steps of 8, up to the cap (always the largest decode
    size). Then, when max_graph_tokens is above it, row counts for steps that carry prefill
    tokens (one row per token, `CudaGraphRunner`): steps of 64 up to 512, of 256 above, and
    max_graph_tokens itself."""
    cap = min(max_num_seqs, max_cuda_graph_batch_size)
    if cap < 1:
        return []
    sizes = [s for s in (1, 2, 4) if s < cap] + list(range(8, cap, 8)) + [cap]
    if max_graph_tokens > cap:
        rows = [n for n in range(64, min(max_graph_tokens, 512) + 1, 64)] + list(range(768, max_graph_tokens, 256))
        sizes += [n for n in rows if cap < n < max_graph_tokens] + [max_graph_tokens]
    return sizes


def select_bucket(buckets: list[int], value: int) -> int | None:
    """The smallest bucket >= value (buckets ascending), or None when value is above them all."""
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


def is_decode_only(num_scheduled_tokens: dict[str, int]) -> bool:
    """A step in which every request computes exactly one token (the decode layout)."""
    return bool(num_scheduled_tokens) and all(n == 1 for n in num_scheduled_tokens.values())


# Decode backends whose graphs may also serve steps with prefill tokens (one row per token):
# those that read each row's blocks in place. The torch reference gathers every row's table
# width, which for a 2,048-row step of 512-block tables is gigabytes per layer.
TOKEN_ROW_BACKENDS = ("triton",)
# Most context tokens the prefill rows of one token-row step may read in all (a row at position p
# reads p + 1). The decode kernel reads each row's context on its own, with no tensor-core tiles,
# so long prompts cost it more than the eager path's SDPA. Break-even measured on an H200
# (SmolLM2-135M shapes, bf16): a token-row step took ~2.6 ms + ~55-63 ns per context token read
# (512 prompt tokens alone: 131k reads, 10.9 ms; a 2,048-token prompt in four 512-token chunks:
# 2.1M reads, 122 ms), an eager step ~17 ms whatever its size: even at ~240k reads. That eager
# step gathered and padded every context; on CudaBackend (workers/model/backend.py) the eager path
# reads the cache in place (the same decode kernel, varlen flash attention for the chunks), so a
# step past this bound no longer falls off a cliff; the bound itself wants re-measuring against it.
MAX_TOKEN_ROW_CONTEXT_READS = 192 * 1024


@dataclass(frozen=True)
class DecodePlan:
    # Rows the forward runs with (real requests, then padding).
    batch_size: int
    # Block-table width the attention reads.
    num_blocks: int
    # True: replay the graph captured for (batch_size, num_blocks); False: run eagerly.
    use_graph: bool


def plan_decode(num_reqs: int, max_num_blocks: int, capture_sizes: list[int], block_buckets: list[int],
                captured: bool) -> DecodePlan:
    """How a decode-only batch runs: padded and replayed when a graph fits, else eagerly."""
    num_blocks = select_bucket(block_buckets, max_num_blocks)
    if num_blocks is None:
        raise ValueError(f"a request needs {max_num_blocks} blocks; the widest table is {block_buckets[-1]}")
    size = select_bucket(capture_sizes, num_reqs) if captured else None
    if size is None:
        return DecodePlan(num_reqs, num_blocks, use_graph=False)
    return DecodePlan(size, num_blocks, use_graph=True)


# ---- capture -----------------------------------------------------------------------------
class Capturer(Protocol):
    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record `forward`; returns (replay, static output that replay refreshes)."""


@functools.cache
def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one side stream of a device that every graph is warmed up and captured on.

    cuBLAS keeps a workspace for each stream it has run on (32 MiB on Hopper) and torch hands out
    new streams round-robin from a pool of 32: a fresh stream per graph cost an H200 380 MiB for
    11 graphs against the 67 MiB the KV budget had set aside for them. The memory profile runs
    its widest decode on this stream too (workers/runner/profiling.py), so that its workspace exists,
    and is counted as in use, before the KV cache is sized."""
    return torch.cuda.Stream(device)


class CudaGraphCapturer:
    """torch.cuda.graph capture on one memory pool shared by every graph of the runner."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: Any = None

    def capture(self, forward):
        # Warm up on the capture stream (lazy cuBLAS/NCCL initialisation must not happen in
        # capture, and the workspace cuBLAS makes for this stream must exist before it).
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            output = forward()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, output


@dataclass
class GraphStats:
    # Decode steps served by a graph replay.
    num_replays: int = 0
    # Decode steps run eagerly (above the largest size, or graphs off).
    num_eager: int = 0
    # Graphs captured, seconds it took, device memory it took (bytes).
    num_graphs: int = 0
    capture_time: float = 0.0
    capture_memory: int = 0


@dataclass
class _Graph:
    replay: Callable[[], None]
    output: torch.Tensor
    meta: AttentionMetadata


class CudaGraphRunner:
    """Runs decode-only batches through captured graphs when `can_use`, else eagerly."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, max_model_len: int, capture_sizes: list[int],
                 backend: DecodeAttentionBackend, device: torch.device, max_num_seqs: int = 0,
                 max_token_rows: int = 0) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.capture_sizes = sorted(capture_sizes)
        self.backend = backend
        self.device = device
        self.max_blocks = cdiv(max_model_len, block_size)
        self.block_buckets = backend.block_buckets(self.max_blocks)
        # One set of buffers for graphs and eager steps alike, as many rows as a step can have.
        max_batch = max(self.capture_sizes[-1] if self.capture_sizes else 1, max_num_seqs)
        self.buffers = DecodeInputBuffers.make(max_batch, self.max_blocks, device)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.stats = GraphStats()
        # Largest step with prefill tokens that replays a graph, in tokens (0: decode-only graphs).
        self.max_token_rows = max_token_rows if backend.name in TOKEN_ROW_BACKENDS else 0

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def can_use(self, batch: DecodeBatch) -> bool:
        """A decode-only batch that a captured graph can serve (after padding)."""
        return plan_decode(batch.num_reqs, batch.max_num_blocks, self.capture_sizes, self.block_buckets,
                           self.captured).use_graph

    def can_replay_rows(self, num_rows: int, prefill_context_reads: int) -> bool:
        """A step of num_rows tokens, prefill tokens among them, whose prefill rows read
        prefill_context_reads context tokens in all, replays a graph: graphs were captured, token
        rows are on (a backend that reads blocks in place), the rows fit, and the reads stay
        under the break-even with the eager path (MAX_TOKEN_ROW_CONTEXT_READS)."""
        return (self.captured and num_rows <= min(self.max_token_rows, self.capture_sizes[-1])
                and prefill_context_reads <= MAX_TOKEN_ROW_CONTEXT_READS)

    # ---- capture -------------------------------------------------------------------------
    def capture(self, capturer: Capturer | None = None) -> None:
        """Capture every (size, width), largest first; call after the KV cache is allocated."""
        capturer = capturer or CudaGraphCapturer(self.device)
        is_cuda = self.device.type == "cuda"
        if is_cuda:
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        keys = sorted(((s, w) for s in self.capture_sizes for w in self.block_buckets), reverse=True)
        with torch.inference_mode():
            for size, width in keys:
                dummy = pad_decode_batch(DecodeBatch([], [], [], [], []), size, self.block_size)
                self.buffers.fill(dummy, width)
                meta = self._make_meta(self.buffers, size, width, for_graph=True)
                self.backend.plan(meta.gpu_decode, dummy.block_tables, dummy.context_lens)
                replay, output = capturer.capture(functools.partial(self._forward, self.buffers, size, meta))
                self.graphs[(size, width)] = _Graph(replay, output, meta)
        if is_cuda:
            torch.cuda.synchronize(self.device)
            self.stats.capture_memory = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.stats.capture_time = time.perf_counter() - start
        self.stats.num_graphs = len(self.graphs)
        logger.info(
            "captured %d decode graphs (batch sizes %s x block-table widths %s, attention %s) in %.2f s, "
            "%.0f MiB of device memory", len(self.graphs), self.capture_sizes, self.block_buckets,
            self.backend.name, self.stats.capture_time, self.stats.capture_memory / MiB,
        )

    # ---- step ----------------------------------------------------------------------------
    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Hidden states [num_reqs, hidden] of a decode-only batch (rows in batch order)."""
        plan = plan_decode(batch.num_reqs, batch.max_num_blocks, self.capture_sizes, self.block_buckets,
                           self.captured)
        padded = pad_decode_batch(batch, plan.batch_size, self.block_size)
        if plan.use_graph:
            graph = self.graphs[(plan.batch_size, plan.num_blocks)]
            self.buffers.fill(padded, plan.num_blocks)
            self.backend.plan(graph.meta.gpu_decode, padded.block_tables, padded.context_lens)
            graph.replay()
            self.stats.num_replays += 1
            return graph.output[: batch.num_reqs]
        if plan.batch_size > self.buffers.input_ids.shape[0]:
            raise ValueError(f"a decode step of {plan.batch_size} requests exceeds max_num_seqs "
                             f"({self.buffers.input_ids.shape[0]} buffer rows)")
        self.buffers.fill(padded, plan.num_blocks)
        meta = self._make_meta(self.buffers, plan.batch_size, plan.num_blocks, for_graph=False)
        self.backend.plan(meta.gpu_decode, padded.block_tables, padded.context_lens)
        self.stats.num_eager += 1
        return self._forward(self.buffers, plan.batch_size, meta)

    def _make_meta(self, buf: DecodeInputBuffers, size: int, width: int, for_graph: bool) -> AttentionMetadata:
        decode = DecodeAttention(buf.block_tables[:size, :width], buf.context_lens[:size], self.backend,
                                 self.backend.make_state(size, width, for_graph))
        return AttentionMetadata(slot_mapping=buf.slot_mapping[:size], num_decodes=size,
                                 decode_block_tables=None, decode_mask=None, prefills=[], gpu_decode=decode)

    def _forward(self, buf: DecodeInputBuffers, size: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(buf.input_ids[:size], buf.positions[:size], self.kv_caches, meta)


def graph_capture_sizes(backend_name: str, max_num_seqs: int, max_cuda_graph_batch_size: int,
                        max_graph_tokens: int) -> list[int]:
    """The capture list of a runner: token-row sizes only for backends that can serve them."""
    tokens = max_graph_tokens if backend_name in TOKEN_ROW_BACKENDS else 0
    return make_capture_sizes(max_num_seqs, max_cuda_graph_batch_size, tokens)


def make_graph_runner(model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *,
                      block_size: int, max_model_len: int, max_num_seqs: int, max_cuda_graph_batch_size: int,
                      dtype: torch.dtype, device: torch.device, attention_backend: str = "auto",
                      max_graph_tokens: int = 0) -> CudaGraphRunner:
    """The decode runner of one rank (graphs are captured by `capture()`, not here)."""
    from workers.attention.graph_decode import make_decode_backend

    attn = model.layers[0].self_attn
    backend = make_decode_backend(attention_backend, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                                  head_dim=attn.head_dim, block_size=block_size, dtype=dtype, device=device)
    sizes = graph_capture_sizes(backend.name, max_num_seqs, max_cuda_graph_batch_size, max_graph_tokens)
    return CudaGraphRunner(model, kv_caches, block_size, max_model_len, sizes, backend, device,
                           max_num_seqs=max_num_seqs, max_token_rows=max_graph_tokens)
