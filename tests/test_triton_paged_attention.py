"""The Triton paged decode kernel against the torch reference (CPU: Triton's interpreter).

Random shapes (GQA groups 1/3/4, head dims 64 and a non-power-of-two 48, block sizes 16 and 8),
ragged context lengths (1, block multiples, one past a block), shuffled block ids, padding rows
(context 1 in the null block), tables wider than any context, one or several splits, a sliding
window and logit soft-capping; then a tiny Llama decoding through the graph runner with this backend,
token-identical to the plain CPU path. On a CUDA machine the same tests run the compiled kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton.jit wraps the kernels (i.e. before the module is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (it is in the `test` extra)")

from scheduler.block_pool import NULL_BLOCK_ID  # noqa: E402
from workers.attention.graph_decode import (  # noqa: E402
    DecodeAttention,
    TorchDecodeAttention,
    TritonDecodeAttention,
    check_against_reference,
    torch_paged_decode,
)
from workers.attention.triton_decode import num_kv_splits, triton_paged_decode  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_case(seed: int, context_lens: list[int], *, num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, num_padding_rows: int = 0, extra_width: int = 1, dtype=torch.float32):
    """Caches with random contents (the null block too), each request's blocks drawn at random
    from the pool, tables padded with the null block, padding rows of context 1 at the end."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-c // block_size) for c in context_lens]
    num_blocks = 1 + sum(pages) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(pages) + extra_width
    tables, lens = [], []
    for n, ctx in zip(pages, context_lens):
        row, ids = ids[:n], ids[n:]
        tables.append(row + [NULL_BLOCK_ID] * (width - n))
        lens.append(ctx)
    for _ in range(num_padding_rows):
        tables.append([NULL_BLOCK_ID] * width)
        lens.append(1)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    to = dict(device=DEVICE)
    return (q.to(**to), k_cache.to(**to), v_cache.to(**to),
            torch.tensor(tables, dtype=torch.int32, **to), torch.tensor(lens, dtype=torch.int32, **to))


def poison_past_context(k_cache, v_cache, tables, lens):
    """(K, V, tables) where every table entry past a request's last block names one block that no
    request holds, filled with NaN: a kernel that reads past a context returns NaN."""
    block_size = k_cache.shape[1]
    num_used = [-(-ctx // block_size) for ctx in lens.tolist()]
    used = {block for row, n in zip(tables.tolist(), num_used) for block in row[:n]}
    stale = next(b for b in range(1, k_cache.shape[0]) if b not in used)
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    poisoned_k[stale] = float("nan")
    poisoned_v[stale] = float("nan")
    stale_tables = tables.clone()
    for row, n in enumerate(num_used):
        stale_tables[row, n:] = stale
    return poisoned_k, poisoned_v, stale_tables


SHAPES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    (4, 4, 64, 16),   # MHA
    (9, 3, 64, 16),   # SmolLM2-135M: groups of 3 (not a power of two)
    (8, 2, 48, 16),   # head dim not a power of two
    (4, 1, 32, 8),    # MQA, a smaller block
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"h{a}kv{b}d{c}bs{d}" for a, b, c, d in SHAPES])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_matches_reference_ragged_contexts_and_padding(shape, num_splits):
    heads, kv_heads, dim, bs = shape
    gen = torch.Generator().manual_seed(heads * 100 + dim + num_splits)
    ragged = [1, bs, bs + 1, 3 * bs - 1] + torch.randint(1, 6 * bs, (2,), generator=gen).tolist()
    q, k, v, tables, lens = make_case(num_splits, ragged, num_heads=heads, num_kv_heads=kv_heads,
                                      head_dim=dim, block_size=bs, num_padding_rows=2)
    got = triton_paged_decode(q, k, v, tables, lens, dim ** -0.5, num_splits=num_splits, min_blocks_per_split=1)
    expected = torch_paged_decode(q, k, v, tables, lens, dim ** -0.5)
    assert got.shape == (len(lens), heads * dim)
    assert torch.isfinite(got).all()  # padding rows too
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("window", "soft_cap"), [(5, None), (16, None), (None, 2.0), (7, 1.5), (1000, None)])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_sliding_window_and_soft_cap_match_reference(window, soft_cap, num_splits):
    q, k, v, tables, lens = make_case(7, [1, 4, 17, 40, 63], num_heads=8, num_kv_heads=2, head_dim=32,
                                      block_size=16, num_padding_rows=1)
    scale = 0.3  # not head_dim ** -0.5: the scale is taken as given
    kwargs = dict(sliding_window=window, logits_soft_cap=soft_cap)
    got = triton_paged_decode(q, k, v, tables, lens, scale, num_splits=num_splits, min_blocks_per_split=1,
                              **kwargs)
    expected = torch_paged_decode(q, k, v, tables, lens, scale, **kwargs)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    if window is not None and window < 40:
        # The window changes the answer for long contexts (the test would pass with it ignored otherwise).
        plain = torch_paged_decode(q, k, v, tables, lens, scale, logits_soft_cap=soft_cap)
        assert not torch.allclose(got[3], plain[3], atol=1e-3)


def test_reference_window_keeps_the_last_w_positions():
    """The reference itself: a window of W equals attention over only the last W keys."""
    q, k, v, tables, lens = make_case(3, [37], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    window = 6
    got = torch_paged_decode(q, k, v, tables, lens, 0.25, sliding_window=window)
    keys = k[tables[0, :3].long()].flatten(0, 1)[37 - window : 37, 0]  # [W, D]
    values = v[tables[0, :3].long()].flatten(0, 1)[37 - window : 37, 0]
    probs = (q[0] @ keys.T * 0.25).softmax(-1)
    torch.testing.assert_close(got[0], (probs @ values).flatten())


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy; saturates to +-cap
def test_soft_cap_bounds_the_scores():
    """With a tiny cap every score is within +-cap, so the output nears the mean of the values."""
    q, k, v, tables, lens = make_case(5, [20], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    q = q * 100
    got = triton_paged_decode(q, k, v, tables, lens, 1.0, logits_soft_cap=1e-4)
    mean_v = v[tables[0, :2].long()].flatten(0, 1)[:20, 0].mean(0)
    torch.testing.assert_close(got[0, :16], mean_v, atol=1e-3, rtol=1e-3)


def test_half_precision_inputs():
    q, k, v, tables, lens = make_case(11, [3, 30], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                                      dtype=torch.float16)
    got = triton_paged_decode(q, k, v, tables, lens, 32 ** -0.5)
    assert got.dtype == torch.float16
    expected = torch_paged_decode(q.float(), k.float(), v.float(), tables, lens, 32 ** -0.5)
    torch.testing.assert_close(got.float(), expected, atol=2e-3, rtol=2e-3)


def test_only_the_blocks_of_the_context_are_read():
    """Entries past a request's last block (stale ids from an earlier, longer step) are never read:
    NaN-poisoned blocks there leave the output unchanged."""
    q, k, v, tables, lens = make_case(13, [20, 5], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                                      extra_width=2)
    expected = triton_paged_decode(q, k, v, tables, lens, 0.2)
    got = triton_paged_decode(q, *poison_past_context(k, v, tables, lens), lens, 0.2)
    torch.testing.assert_close(got, expected)


def test_backend_interface_and_start_check():
    backend = TritonDecodeAttention()
    assert backend.block_buckets(512) == [512]  # reads in place: one table width serves all
    error = check_against_reference(backend, TorchDecodeAttention(), num_heads=8, num_kv_heads=2, head_dim=32,
                                    block_size=16, dtype=torch.float32, device=DEVICE)
    assert error < 1e-5
    q, k, v, tables, lens = make_case(17, [9, 33], num_heads=8, num_kv_heads=2, head_dim=32, block_size=16)
    meta = DecodeAttention(tables, lens, backend)
    got = meta.forward(q, k, v, 0.5, sliding_window=8, logits_soft_cap=3.0)
    ref = DecodeAttention(tables, lens, TorchDecodeAttention()).forward(q, k, v, 0.5, sliding_window=8,
                                                                         logits_soft_cap=3.0)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("batch", "kv_heads", "max_blocks", "expected"), [
    (1, 3, 64, 8),      # one request: split its 64 blocks 8 ways (>= 8 blocks each)
    (1, 8, 8192, 32),   # 128k context: capped at 32 splits
    (64, 8, 8192, 1),   # 512 programs already
    (8, 3, 4, 1),       # short tables are never split
    (2, 2, 1000, 32),
])
def test_num_kv_splits(batch, kv_heads, max_blocks, expected):
    assert num_kv_splits(batch, kv_heads, max_blocks) == expected


def test_rejects_shapes_the_kernel_cannot_serve():
    q, k, v, tables, lens = make_case(1, [5], num_heads=6, num_kv_heads=4, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="group"):
        triton_paged_decode(q, k[..., :4, :], v[..., :4, :], tables, lens, 1.0)


# ---- the kernel inside the graph runner, end to end -------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreted CPU stand-in; on CUDA, Triton takes no CPU tensors and "
                           "tests/gpu/test_gpu_graphs.py replays real graphs with the compiled kernel")
def test_graph_runner_with_the_triton_kernel_is_token_identical_to_the_cpu_path(tmp_path):
    """A tiny Llama decoding through the CUDA-graph runner with the Triton backend (graphs stood in
    for by re-running the forward on the static buffers), greedy tokens equal to the plain path."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    from gpu_helpers import RerunCapturer, StepDriver, compare_greedy, random_prompts
    from model_fixtures import make_tiny_llama
    from workers.runner.cuda_graph import CudaGraphRunner
    from workers.distributed.parallel_state import SINGLE_RANK
    from workers.worker import WorkerConfig, WorkerCore

    path = make_tiny_llama(tmp_path / "llama", num_heads=8, num_kv_heads=2)
    block_size = 8

    def worker() -> WorkerCore:
        cfg = WorkerConfig(model_path=path, dtype=torch.float32, block_size=block_size, max_model_len=128,
                           kv_cache_memory_gib=0.01, gpu_memory_utilization=0.9, device="cpu", max_num_seqs=4)
        core = WorkerCore(cfg, SINGLE_RANK)
        core.load_model()
        core.init_kv_cache(64)
        return core

    plain, graphed = worker(), worker()
    runner = CudaGraphRunner(graphed.model, graphed.runner.kv_caches, block_size, 128, [1, 2, 4],
                             TritonDecodeAttention(), torch.device("cpu"), max_num_seqs=4)
    runner.capture(RerunCapturer())
    graphed.runner.graph_runner = runner
    assert runner.block_buckets == [16] and runner.stats.num_graphs == 3
    prompts = random_prompts(3, seed=5, max_len=12)
    num_tokens = 12
    reference = StepDriver(plain, block_size).run_greedy(prompts, num_tokens, logprobs=None)
    candidate = StepDriver(graphed, block_size).run_greedy(prompts, num_tokens, logprobs=None)
    for ref, cand in zip(reference.tokens, candidate.tokens):
        assert compare_greedy(ref, cand).diverged_at is None
    assert runner.stats.num_replays == num_tokens - 1  # batch 3 padded to the 4 graph


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreted CPU stand-in; on CUDA the GPU check runs the engine with real graphs")
def test_token_row_graphs_serve_steps_with_prefill_chunks_with_the_flat_paths_tokens(tmp_path):
    """An engine whose every step (chunked prefills beside decodes, a chunk after a prefix-cache
    hit, decode-only steps) replays token-row graphs (stood in for by re-running the forward on
    the static buffers) gives the greedy tokens of the flat path, which HF checks elsewhere."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    from engine_helpers import greedy, make_engine, run_engine
    from gpu_helpers import RerunCapturer
    from model_fixtures import make_tiny_llama
    from workers.runner.cuda_graph import CudaGraphRunner, make_capture_sizes

    path = make_tiny_llama(tmp_path / "llama", num_heads=8, num_kv_heads=2, num_layers=1)
    budget = 12
    settings = dict(block_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=budget,
                    min_num_batched_tokens=budget, num_batched_tokens_per_request=0)
    shared = [300 + k for k in range(16)]  # two full blocks: a prefix-cache hit for the second
    requests = {"a": (shared + [7, 8, 9], greedy(5)), "b": ([500 + k for k in range(9)], greedy(6)),
                "c": ([900, 901, 902], greedy(7))}
    plain = make_engine(path, **settings)
    reference = run_engine(plain, requests)
    reference.update(run_engine(plain, {"d": (shared + [11, 12], greedy(4))}))

    graphed = make_engine(path, **settings)
    worker = graphed.executor.worker
    runner = CudaGraphRunner(worker.model, worker.runner.kv_caches, 8, 64, make_capture_sizes(4, 256, budget),
                             TritonDecodeAttention(), torch.device("cpu"), max_num_seqs=4, max_token_rows=budget)
    runner.capture(RerunCapturer())
    worker.runner.graph_runner = runner
    scheduled: list[list[int]] = []  # tokens per request, every step
    execute = worker.runner.execute_model

    def recording(out):
        if not out.is_empty:
            scheduled.append(sorted(out.num_scheduled_tokens.values()))
        return execute(out)

    graphed.executor.execute_model = recording
    outputs = run_engine(graphed, requests)
    graphed.add_request("d", shared + [11, 12], greedy(4))
    outputs["d"], cached = [], 0
    while graphed.has_unfinished_requests():
        for out in graphed.step():
            outputs["d"] += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
    assert outputs == reference
    assert runner.stats.num_replays == len(scheduled) and runner.stats.num_eager == 0  # every step a graph
    assert any(1 in s and max(s) > 1 for s in scheduled)  # prefill chunks beside decodes
    assert cached == 16  # "d" read the shared blocks from the cache, then its chunk ran as rows
    assert graphed.num_used_kv_blocks == 0


def test_strided_queries_are_read_in_place():
    """q as the model hands it over: a view of a fused QKV projection (rows strided)."""
    q, k, v, tables, lens = make_case(19, [5, 40], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    fused = torch.cat([q.flatten(1), torch.randn(2, 64, device=DEVICE)], dim=1)  # [B, (H + 2) * D]
    view = fused[:, : 4 * 32].view(2, 4, 32)
    assert not view.is_contiguous()
    torch.testing.assert_close(triton_paged_decode(view, k, v, tables, lens, 0.3),
                               torch_paged_decode(q, k, v, tables, lens, 0.3), atol=2e-5, rtol=1e-4)
