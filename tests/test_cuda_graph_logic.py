"""The CUDA-graph decode logic, on CPU: capture sizes, bucket choice, null-block padding, static
buffers, eager-fallback decisions, backend choice, the graph-safe decode kernel against the CPU
attention, and the whole decode path through the graph runner with a stand-in for CUDA graphs
("replay" re-runs the forward on the static buffers) token-identical to the plain CPU path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.sampling_params import SamplingParams
from workers.attention.paged import AttentionMetadata
from workers.model.backend import TORCH
from scheduler.block_pool import NULL_BLOCK_ID as NULL_BLOCK
from workers.runner.cuda_graph import (
    CudaGraphRunner,
    DecodePlan,
    is_decode_only,
    make_capture_sizes,
    plan_decode,
    select_bucket,
)
from workers.runner.decode_inputs import (
    DecodeBatch,
    DecodeInputBuffers,
    make_decode_batch,
    pad_decode_batch,
    padded_block_tables,
)
from workers.attention.graph_decode import (
    DecodeAttention,
    TorchDecodeAttention,
    backend_candidates,
    check_against_reference,
    context_block_buckets,
    make_decode_backend,
)
from workers.distributed.parallel_state import SINGLE_RANK
from workers.worker import WorkerConfig, WorkerCore

# The GPU tests' helpers (driver, greedy comparison) live beside them in tests/gpu.
sys.path.insert(0, str(Path(__file__).parent / "gpu"))
from gpu_helpers import RerunCapturer, StepDriver, compare_greedy, random_prompts  # noqa: E402

BLOCK_SIZE = 4


# ---- capture sizes and buckets ------------------------------------------------------------
@pytest.mark.parametrize(("max_num_seqs", "cap", "expected"), [
    (64, 256, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    (20, 256, [1, 2, 4, 8, 16, 20]),
    (64, 24, [1, 2, 4, 8, 16, 24]),
    (8, 256, [1, 2, 4, 8]),
    (3, 256, [1, 2, 3]),
    (1, 256, [1]),
])
def test_capture_sizes(max_num_seqs, cap, expected):
    assert make_capture_sizes(max_num_seqs, cap) == expected


def test_capture_sizes_default_cap_is_steps_of_8_to_256():
    sizes = make_capture_sizes(1024, 256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


def test_token_row_sizes_follow_the_decode_sizes_up_to_max_graph_tokens():
    sizes = make_capture_sizes(64, 256, 2048)
    assert sizes[: sizes.index(64) + 1] == make_capture_sizes(64, 256)
    assert sizes[sizes.index(64) + 1 :] == [128, 192, 256, 320, 384, 448, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert make_capture_sizes(8, 256, 100) == [1, 2, 4, 8, 64, 100]  # the cap is always captured
    assert make_capture_sizes(64, 256, 48) == make_capture_sizes(64, 256)  # at or below the decode cap: nothing


def test_token_rows_only_with_a_backend_that_reads_blocks_in_place():
    from workers.runner.cuda_graph import graph_capture_sizes

    assert graph_capture_sizes("triton", 64, 256, 512)[-1] == 512
    assert graph_capture_sizes("torch", 64, 256, 512) == make_capture_sizes(64, 256)


def test_which_steps_with_prefill_tokens_replay_token_row_graphs():
    from workers.runner.cuda_graph import MAX_TOKEN_ROW_CONTEXT_READS, CudaGraphRunner

    class InPlaceBackend(TorchDecodeAttention):  # reads blocks in place, as the Triton kernel
        name = "triton"

    def runner(backend, max_token_rows, captured=True):
        r = CudaGraphRunner(torch.nn.Identity(), [], BLOCK_SIZE, 64, make_capture_sizes(4, 256, 128), backend,
                            torch.device("cpu"), max_num_seqs=4, max_token_rows=max_token_rows)
        if captured:
            r.graphs[(1, 4)] = None  # what capture() leaves: any graph
        return r

    on = runner(InPlaceBackend(), 128)
    assert on.can_replay_rows(128, MAX_TOKEN_ROW_CONTEXT_READS)
    assert not on.can_replay_rows(129, 0)  # no graph holds the rows
    assert not on.can_replay_rows(64, MAX_TOKEN_ROW_CONTEXT_READS + 1)  # long contexts: eager SDPA is cheaper
    assert not runner(InPlaceBackend(), 0).can_replay_rows(4, 10)  # 0: decode-only graphs
    assert not runner(TorchDecodeAttention(), 128).can_replay_rows(4, 10)  # the gathering backend
    assert not runner(InPlaceBackend(), 128, captured=False).can_replay_rows(4, 10)  # enforce_eager


@pytest.mark.parametrize(("value", "expected"), [(1, 1), (3, 4), (5, 8), (9, 16), (17, 24), (64, 64), (65, None)])
def test_select_bucket_is_the_next_captured_size(value, expected):
    assert select_bucket(make_capture_sizes(64, 256), value) == expected


@pytest.mark.parametrize(("max_blocks", "expected"), [
    (512, [16, 64, 256, 512]), (64, [16, 64]), (100, [16, 64, 100]), (16, [16]), (10, [10]),
])
def test_context_block_buckets(max_blocks, expected):
    assert context_block_buckets(max_blocks) == expected


# ---- padding and static buffers -----------------------------------------------------------
def _batch() -> DecodeBatch:
    # Request A: 6 tokens known, 5 computed (feeds token 5); request B: 2 known, 1 computed.
    return make_decode_batch([([10, 11, 12, 13, 14, 15], [7, 9], 5), ([20, 21], [3], 1)], BLOCK_SIZE)


def test_make_decode_batch_feeds_the_first_uncomputed_token():
    batch = _batch()
    assert batch.token_ids == [15, 21]
    assert batch.positions == [5, 1]
    assert batch.slots == [9 * BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 1]
    assert batch.block_tables == [[7, 9], [3]]
    assert batch.context_lens == [6, 2]
    assert batch.max_num_blocks == 2


def test_padding_requests_use_only_the_null_block():
    padded = pad_decode_batch(_batch(), 4, BLOCK_SIZE)
    assert padded.num_reqs == 4
    assert padded.token_ids[2:] == [0, 0] and padded.positions[2:] == [0, 0]
    assert padded.slots[2:] == [NULL_BLOCK * BLOCK_SIZE] * 2
    assert padded.block_tables[2:] == [[NULL_BLOCK]] * 2
    # Context length 1: the dummy attends to its own key in the null block (no empty softmax).
    assert padded.context_lens[2:] == [1, 1]
    assert padded_block_tables(padded.block_tables, 3) == [[7, 9, 0], [3, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert pad_decode_batch(_batch(), 2, BLOCK_SIZE).token_ids == [15, 21]
    with pytest.raises(ValueError):
        pad_decode_batch(_batch(), 1, BLOCK_SIZE)


def test_rows_sharing_one_table_are_written_like_separate_rows():
    """A prefill chunk's token rows share one list (ModelRunner._run_rows); fill() writes runs of
    the same list at once, and must give what row-by-row writing gives."""
    chunk = [4, 8, 6]
    tables = [[7, 9], chunk, chunk, chunk, [5], [5], [2, 3, 1, 11]]  # [5], [5]: equal, not shared
    n = len(tables)
    batch = DecodeBatch(list(range(n)), list(range(n)), list(range(n)), tables, [1] * n)
    buf = DecodeInputBuffers.make(8, 5, torch.device("cpu"))
    buf.fill(batch, num_blocks=5)
    assert buf.block_tables[:n, :4].tolist() == padded_block_tables(tables, 4)


def test_static_buffers_are_refilled_in_place():
    buf = DecodeInputBuffers.make(8, 5, torch.device("cpu"))
    addresses = [t.data_ptr() for t in (buf.input_ids, buf.positions, buf.slot_mapping, buf.block_tables,
                                        buf.context_lens)]
    staging = {name: t.data_ptr() for name, t in buf.staging.items()}
    buf.block_tables.fill_(99)  # stale rows from an earlier, longer step
    buf.fill(pad_decode_batch(_batch(), 4, BLOCK_SIZE), num_blocks=3)
    assert buf.input_ids[:4].tolist() == [15, 21, 0, 0]
    assert buf.positions[:4].tolist() == [5, 1, 0, 0]
    assert buf.slot_mapping[:4].tolist() == [37, 13, 0, 0]
    # Rows are written (null-padded) up to the widest row, 2 blocks; entries past it are never read
    # unmasked (kernels stop at the context length), so they may keep an earlier step's ids.
    assert buf.block_tables[:4, :2].tolist() == [[7, 9], [3, 0], [0, 0], [0, 0]]
    assert buf.block_tables[4:].eq(99).all()
    assert buf.context_lens[:4].tolist() == [6, 2, 1, 1]
    assert {name: t.data_ptr() for name, t in buf.staging.items()} == staging  # host mirrors reused too
    with pytest.raises(ValueError, match="needs 2 blocks"):
        buf.fill(_batch(), num_blocks=1)
    assert buf.block_tables.dtype == torch.int32 and buf.context_lens.dtype == torch.int32
    assert addresses == [t.data_ptr() for t in (buf.input_ids, buf.positions, buf.slot_mapping,
                                                buf.block_tables, buf.context_lens)]


# ---- eager-fallback decisions -------------------------------------------------------------
@pytest.mark.parametrize(("num_scheduled", "expected"), [
    ({"a": 1, "b": 1}, True), ({"a": 1}, True), ({"a": 1, "b": 7}, False), ({"a": 7}, False), ({}, False),
])
def test_only_decode_only_steps_reach_the_graph_runner(num_scheduled, expected):
    assert is_decode_only(num_scheduled) is expected


def test_plan_pads_to_the_next_size_and_the_narrowest_width():
    sizes, widths = make_capture_sizes(64, 256), [16, 64, 256, 512]
    assert plan_decode(3, 2, sizes, widths, captured=True) == DecodePlan(4, 16, True)
    assert plan_decode(17, 17, sizes, widths, captured=True) == DecodePlan(24, 64, True)
    assert plan_decode(64, 512, sizes, widths, captured=True) == DecodePlan(64, 512, True)


def test_plan_falls_back_to_eager_above_the_largest_size_or_without_graphs():
    sizes, widths = make_capture_sizes(64, 256), [16, 64]
    assert plan_decode(65, 3, sizes, widths, captured=True) == DecodePlan(65, 16, False)
    # enforce_eager: nothing captured, the batch runs as it is (no padding).
    assert plan_decode(3, 3, sizes, widths, captured=False) == DecodePlan(3, 16, False)
    assert plan_decode(3, 3, [], widths, captured=True) == DecodePlan(3, 16, False)
    with pytest.raises(ValueError):
        plan_decode(1, 65, sizes, widths, captured=True)


def test_can_use_predicate():
    runner = CudaGraphRunner(torch.nn.Identity(), [], BLOCK_SIZE, 64, [1, 2, 4], TorchDecodeAttention(),
                             torch.device("cpu"), max_num_seqs=8)
    assert runner.buffers.input_ids.shape[0] == 8  # eager steps above the largest graph fit too
    batch3 = make_decode_batch([([1, 2], [1], 1)] * 3, BLOCK_SIZE)
    assert not runner.can_use(batch3)  # nothing captured yet (enforce_eager / CPU)
    runner.graphs[(4, 16)] = object()
    assert runner.can_use(batch3)
    assert not runner.can_use(make_decode_batch([([1, 2], [1], 1)] * 5, BLOCK_SIZE))


# ---- attention backend choice -------------------------------------------------------------
def test_backend_candidates():
    bf16 = torch.bfloat16
    everything = {"torch", "flash_attn", "flashinfer"}
    assert backend_candidates("auto", everything, device_type="cpu", block_size=16, dtype=bf16) == ["torch"]
    assert backend_candidates("auto", {"torch"}, device_type="cuda", block_size=16, dtype=bf16) == ["torch"]
    # FA2's paged KV needs blocks of a multiple of 256 tokens.
    assert backend_candidates("auto", everything, device_type="cuda", block_size=16, dtype=bf16) == [
        "flashinfer", "torch"]
    assert backend_candidates("auto", everything, device_type="cuda", block_size=256, dtype=bf16) == [
        "flash_attn", "flashinfer", "torch"]
    assert backend_candidates("auto", everything, device_type="cuda", block_size=256,
                              dtype=torch.float32) == ["torch"]
    assert backend_candidates("flash_attn", {"torch"}, device_type="cuda", block_size=256, dtype=bf16) == ["torch"]
    assert backend_candidates("torch", everything, device_type="cuda", block_size=16, dtype=bf16) == ["torch"]
    with pytest.raises(ValueError):
        backend_candidates("xformers", everything, device_type="cuda", block_size=16, dtype=bf16)
    # Our Triton kernel comes first on CUDA in any float dtype, for power-of-two block sizes.
    with_triton = everything | {"triton"}
    assert backend_candidates("auto", with_triton, device_type="cuda", block_size=16, dtype=bf16) == [
        "triton", "flashinfer", "torch"]
    assert backend_candidates("auto", with_triton, device_type="cuda", block_size=16,
                              dtype=torch.float32) == ["triton", "torch"]
    assert backend_candidates("auto", with_triton, device_type="cuda", block_size=24, dtype=bf16) == [
        "flashinfer", "torch"]
    assert backend_candidates("auto", with_triton, device_type="cpu", block_size=16, dtype=bf16) == ["torch"]


def test_cpu_gets_the_torch_backend():
    backend = make_decode_backend("auto", num_heads=8, num_kv_heads=2, head_dim=16, block_size=16,
                                  dtype=torch.float32, device=torch.device("cpu"))
    assert backend.name == "torch"


def test_a_kernel_library_that_fails_to_load_falls_back_to_torch(monkeypatch):
    import workers.attention.graph_decode as ga

    # Claimed installed, but importing it fails (no such module here): the start check skips it.
    monkeypatch.setattr(ga, "available_backends", lambda: {"torch", "flashinfer"})
    backend = make_decode_backend("auto", num_heads=8, num_kv_heads=2, head_dim=16, block_size=16,
                                  dtype=torch.bfloat16, device=torch.device("cuda"))
    assert backend.name == "torch"


def test_start_check_measures_the_error_against_torch():
    kwargs = dict(num_heads=8, num_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE, dtype=torch.float32,
                  device=torch.device("cpu"))
    assert check_against_reference(TorchDecodeAttention(), TorchDecodeAttention(), **kwargs) < 1e-6

    class Wrong(TorchDecodeAttention):
        def forward(self, q, k_cache, v_cache, meta, scale, **options):
            return super().forward(q, k_cache, v_cache, meta, scale * 2, **options)

    assert check_against_reference(Wrong(), TorchDecodeAttention(), **kwargs) > 2e-2


# ---- the graph-safe decode kernel equals the CPU decode attention -------------------------
@pytest.mark.parametrize("width", [4, 8])
def test_torch_decode_kernel_matches_cpu_attention(width):
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 8, 2, 16, BLOCK_SIZE
    k_cache = torch.randn(20, bs, kv_heads, dim)
    v_cache = torch.randn(20, bs, kv_heads, dim)
    real = make_decode_batch([(list(range(9)), [3, 5, 7], 8), (list(range(2)), [11], 1),
                              (list(range(13)), [12, 13, 14, 15], 12)], bs)
    padded = pad_decode_batch(real, 4, bs)
    q = torch.randn(4, heads, dim)
    k_new, v_new = torch.randn(4, kv_heads, dim), torch.randn(4, kv_heads, dim)
    slots = torch.tensor(padded.slots)

    # The CPU path: tables padded to the batch's widest, mask from the context lengths.
    k1, v1 = k_cache.clone(), v_cache.clone()
    tables = torch.tensor(padded_block_tables(real.block_tables, 4))
    lens = torch.tensor(real.context_lens)
    mask = (torch.arange(4 * bs)[None, :] < lens[:, None])[:, None, None, :]
    cpu_meta = AttentionMetadata(slots[:3], 3, tables, mask, [])
    expected = TORCH.attention(q[:3], k_new[:3], v_new[:3], k1, v1, cpu_meta, 0.25)

    # The graph-safe kernel, padded batch, a wider static table.
    k2, v2 = k_cache.clone(), v_cache.clone()
    decode = DecodeAttention(torch.tensor(padded_block_tables(padded.block_tables, width), dtype=torch.int32),
                             torch.tensor(padded.context_lens, dtype=torch.int32), TorchDecodeAttention())
    meta = AttentionMetadata(slots, 4, None, None, [], gpu_decode=decode)
    got = TORCH.attention(q, k_new, v_new, k2, v2, meta, 0.25)
    torch.testing.assert_close(got[:3], expected)
    assert torch.isfinite(got).all()
    # Padding wrote only into the null block.
    changed = (k2 != k1).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [NULL_BLOCK]


# ---- graph-vs-eager tolerance as vLLM's check_logprobs_close ------------------------------
def test_identical_runs_are_acceptable():
    result = compare_greedy([1, 2, 3], [1, 2, 3], [[1], [2], [3]], [[1], [2], [3]])
    assert result.diverged_at is None and result.is_acceptable


def test_a_difference_is_accepted_only_inside_both_top_k():
    ref_top = [[1, 9], [2, 7, 8], [3]]
    # Position 1: 7 is in the reference's top-k and 2 in the candidate's: accepted, and later
    # positions (where the runs have diverged) are not compared.
    ok = compare_greedy([1, 2, 3], [1, 7, 4], ref_top, [[1], [7, 2], [4]])
    assert ok.diverged_at == 1 and ok.within_top_k and ok.is_acceptable
    # 5 is not in the reference's top-k.
    bad = compare_greedy([1, 2, 3], [1, 5, 3], ref_top, [[1], [5, 2], [3]])
    assert bad.diverged_at == 1 and not bad.is_acceptable
    # 2 is not in the candidate's top-k (the symmetric half of the rule).
    bad = compare_greedy([1, 2, 3], [1, 7, 3], ref_top, [[1], [7, 8], [3]])
    assert not bad.is_acceptable
    # No logprobs to judge by, or a missing token: not acceptable.
    assert not compare_greedy([1, 2], [1, 7]).is_acceptable
    assert not compare_greedy([1, 2], [1], ref_top, [[1]]).is_acceptable


# ---- the whole decode path on CPU, graphs stood in for ------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from model_fixtures import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("graphs") / "llama", num_heads=8, num_kv_heads=2)


def _cpu_worker(path: str) -> WorkerCore:
    cfg = WorkerConfig(model_path=path, dtype=torch.float32, block_size=BLOCK_SIZE, max_model_len=256,
                       kv_cache_memory_gib=0.01, gpu_memory_utilization=0.9, device="cpu", max_num_seqs=24)
    worker = WorkerCore(cfg, SINGLE_RANK)
    worker.load_model()
    worker.init_kv_cache(512)
    return worker


def _attach_graphs(worker: WorkerCore, capture_sizes: list[int]) -> tuple[CudaGraphRunner, RerunCapturer]:
    runner = CudaGraphRunner(worker.model, worker.runner.kv_caches, BLOCK_SIZE, worker.config.max_model_len,
                             capture_sizes, TorchDecodeAttention(), torch.device("cpu"),
                             max_num_seqs=worker.config.max_num_seqs)
    capturer = RerunCapturer()
    runner.capture(capturer)
    worker.runner.graph_runner = runner
    return runner, capturer


@pytest.fixture(scope="module")
def workers(tiny_path):
    plain = _cpu_worker(tiny_path)
    graphed = _cpu_worker(tiny_path)
    runner, capturer = _attach_graphs(graphed, [1, 2, 4, 8, 16])
    return plain, graphed, runner, capturer


def test_cpu_worker_has_no_graph_runner(workers):
    plain, _, _, _ = workers
    assert plain.runner.graph_runner is None


def test_capture_covers_every_size_and_width_largest_first(workers):
    _, _, runner, capturer = workers
    # max_model_len 256 / block 4 = 64 blocks: widths [16, 64].
    assert runner.block_buckets == [16, 64]
    assert capturer.num_captures == runner.stats.num_graphs == 5 * 2
    assert list(runner.graphs) == sorted(runner.graphs, reverse=True)


@pytest.mark.parametrize("batch_size", [1, 3, 17])
def test_graph_path_is_token_identical_to_the_cpu_path(workers, batch_size):
    plain, graphed, runner, _ = workers
    prompts = random_prompts(batch_size, seed=batch_size, max_len=20, vocab=49152)
    num_tokens = 64
    replays, eager = runner.stats.num_replays, runner.stats.num_eager
    reference = StepDriver(plain, BLOCK_SIZE).run_greedy(prompts, num_tokens)
    candidate = StepDriver(graphed, BLOCK_SIZE).run_greedy(prompts, num_tokens)
    for ref, cand in zip(reference.tokens, candidate.tokens):
        assert compare_greedy(ref, cand).diverged_at is None
    # Every step after the prefill was a decode-only step; batch 17 is above the largest size.
    if batch_size <= 16:
        assert runner.stats.num_replays - replays == num_tokens - 1
    else:
        assert runner.stats.num_eager - eager == num_tokens - 1
    # Padding never touched a block outside the requests' own and the null block.
    used = 1 + sum(-(-(len(p) + num_tokens) // BLOCK_SIZE) for p in prompts)
    k_cache = graphed.runner.kv_caches[0][0]
    assert not k_cache[used:].any()


def test_one_token_chunks_go_through_the_decode_path(workers):
    """A 1-token step that is not the last prompt token computes KV but samples nothing."""
    plain, graphed, runner, _ = workers
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompt = [5, 6, 7, 8, 9]
    results = []
    for worker in (plain, graphed):
        rid = f"chunks-{len(results)}"
        steps = [
            SchedulerOutput(scheduled_new_reqs=[NewRequestData(rid, prompt, params, [1, 2, 3], 0)],
                            num_scheduled_tokens={rid: 3}, total_num_scheduled_tokens=3),
            SchedulerOutput(scheduled_cached_reqs=[CachedRequestData(rid, False, [], [], 3)],
                            num_scheduled_tokens={rid: 1}, total_num_scheduled_tokens=1),
            SchedulerOutput(scheduled_cached_reqs=[CachedRequestData(rid, False, [], [], 4)],
                            num_scheduled_tokens={rid: 1}, total_num_scheduled_tokens=1),
        ]
        replays = runner.stats.num_replays
        outs = [worker.execute_model(s) for s in steps]
        assert outs[0].sampled_token_ids == {} and outs[1].sampled_token_ids == {}
        results.append(outs[2].sampled_token_ids[rid])
        worker.execute_model(SchedulerOutput(finished_req_ids={rid}))
        if worker is graphed:
            assert runner.stats.num_replays - replays == 2
    assert results[0] == results[1]
