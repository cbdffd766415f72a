"""bench.online.serve_load against a tiny fake OpenAI-compatible SSE server (no model), and workload seeding.

The fake server sleeps known gaps before each chunk, so the client's TTFT/ITL must reflect chunk
arrival times. Bounds are generous: CI machines are shared and slow.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import time
from contextlib import redirect_stdout

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from asgi_server import serve_asgi
from bench import workload
from bench.online import serve_load
from bench.online.serve_load import LoadConfig, run_load
from bench.workload import BenchRequest
from engine_helpers import make_engine
from kernel_requirements import requires_kernels
from model_fixtures import make_tiny_llama
from workers.cpu import kernels as cpu_ops

TTFT_S = 0.15  # the fake server waits this long before the first chunk
GAP_S = 0.04  # and this long between later chunks


async def _models(request: Request):
    return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


async def _completions(request: Request):
    body = await request.json()
    if "FAIL" in body["prompt"]:
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)
    n = body["max_tokens"]

    async def events():
        for i in range(n):
            await asyncio.sleep(TTFT_S if i == 0 else GAP_S)
            chunk = {"id": "c", "object": "text_completion", "model": body["model"],
                     "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
        # Finish chunk without text, then usage with no choices, as vLLM sends them.
        yield 'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n'
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake_server():
    app = Starlette(routes=[Route("/v1/models", _models), Route("/v1/completions", _completions, methods=["POST"])])
    with serve_asgi(app) as url:
        yield url


def _tiny_tokenizer():
    """A BPE tokenizer trained in-process on a few sentences: no files, no hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "serving large language models fast",
              "paged attention and continuous batching", "tokens per second per user"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def test_load_against_fake_server(fake_server):
    reqs = [BenchRequest(f"prompt {i}", 7, 5) for i in range(6)] + [BenchRequest("FAIL", 1, 5)]
    cfg = LoadConfig(base_url=fake_server + "/v1/", requests=reqs, num_prompts=7, max_concurrency=4,
                     request_rate=math.inf, warmup=1, max_duration_s=30)
    t0 = time.perf_counter()
    out = asyncio.run(run_load(cfg))
    assert time.perf_counter() - t0 < 20
    assert out["model"] == "fake-model"  # asked /v1/models
    assert out["completed"] == 6 and out["failed"] == 1
    assert "HTTP 500" in out["errors"][0]
    assert out["total_output_tokens"] == 30 and out["total_input_tokens"] == 42
    for key in ("duration_s", "request_throughput", "output_token_throughput", "total_token_throughput"):
        assert out[key] > 0
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean", "median", "p99"):
            assert f"{stat}_{metric}_ms" in out
    assert out["p99_itl_ms"] <= out["p999_itl_ms"] <= out["max_itl_ms"]
    # Times come from chunk arrival: TTFT ~150 ms, each gap ~40 ms, e2e ~150 + 4*40 ms.
    assert TTFT_S * 1000 * 0.9 <= out["median_ttft_ms"] < 1500
    assert GAP_S * 1000 * 0.9 <= out["median_itl_ms"] < 400
    assert GAP_S * 1000 * 0.9 <= out["median_tpot_ms"] < 400
    assert (TTFT_S + 4 * GAP_S) * 1000 * 0.9 <= out["median_e2e_ms"] < 3000
    assert out["output_token_throughput"] == pytest.approx(30 / out["duration_s"])


def test_the_itl_tail_past_p99_tells_rare_long_stalls_from_many_short_ones():
    """1,000 gaps each: five 1 s stalls among 40 ms steps hide under p99 (40 ms) but not under
    p99.9 or the max; fifty 150 ms steps show at p99 already and stop there."""
    rare = [0.04] * 995 + [1.0] * 5
    many = [0.04] * 950 + [0.15] * 50
    assert serve_load.percentile([g * 1000 for g in rare], 99) == pytest.approx(40)
    assert serve_load.itl_tail(rare) == {"p999_itl_ms": pytest.approx(1000), "max_itl_ms": pytest.approx(1000)}
    assert serve_load.percentile([g * 1000 for g in many], 99) == pytest.approx(150)
    assert serve_load.itl_tail(many) == {"p999_itl_ms": pytest.approx(150), "max_itl_ms": pytest.approx(150)}
    assert serve_load.itl_tail([]) == {"p999_itl_ms": 0.0, "max_itl_ms": 0.0}


def test_goodput_counts_requests_within_both_service_levels(fake_server):
    """Goodput = completed requests whose TTFT and TPOT both meet the service levels, per second.
    The fake server's sleeps bound TTFT (>= 150 ms) and TPOT (>= 40 ms) from below, so a level
    under either bound admits no request, and loose levels admit every completed one."""
    reqs = [BenchRequest(f"prompt {i}", 7, 5) for i in range(4)] + [BenchRequest("FAIL", 1, 5)]

    def run(ttft_ms, tpot_ms):
        return asyncio.run(run_load(LoadConfig(base_url=fake_server, requests=reqs, num_prompts=5, warmup=0,
                                               max_duration_s=30, goodput_ttft_ms=ttft_ms, goodput_tpot_ms=tpot_ms)))

    loose = run(20_000, 5_000)
    assert loose["goodput_slos_ms"] == {"ttft": 20_000, "tpot": 5_000}
    assert loose["good_requests"] == 4  # the failed request never counts
    assert loose["request_goodput"] == pytest.approx(4 / loose["duration_s"])
    for ttft_ms, tpot_ms in ((TTFT_S * 1000 * 0.5, 5_000), (20_000, GAP_S * 1000 * 0.5)):
        tight = run(ttft_ms, tpot_ms)
        assert tight["completed"] == 4 and tight["good_requests"] == 0 and tight["request_goodput"] == 0


def test_poisson_rate_and_time_cap(fake_server):
    reqs = [BenchRequest(f"p{i}", 7, 3) for i in range(4)]
    # 2 req/s Poisson: the arrivals alone spread the run out over roughly 1.5 s on average.
    out = asyncio.run(run_load(LoadConfig(base_url=fake_server, requests=reqs, request_rate=2.0,
                                          warmup=0, max_duration_s=30, seed=1)))
    assert out["completed"] == 4 and out["request_rate"] == 2.0
    # A cap shorter than one request: nothing completes, everything is counted as failed.
    out = asyncio.run(run_load(LoadConfig(base_url=fake_server, requests=reqs, warmup=0, max_duration_s=0.05)))
    assert out["completed"] == 0 and out["failed"] == 4


def test_cli_prints_one_json_object(fake_server, tmp_path):
    _tiny_tokenizer().save_pretrained(tmp_path / "tok")
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = serve_load.main(["--base-url", fake_server, "--tokenizer", str(tmp_path / "tok"), "--num-prompts", "3",
                              "--input-len-min", "5", "--input-len-max", "9", "--output-len", "2", "--ignore-eos"])
    assert rc == 0
    out = json.loads(buf.getvalue())
    assert out["completed"] == 3 and out["total_output_tokens"] == 6


def test_workload_is_deterministic(tmp_path):
    tok = _tiny_tokenizer()
    a = workload.random_requests(tok, 8, 10, 30, 16, seed=3)
    b = workload.random_requests(tok, 8, 10, 30, 16, seed=3)
    c = workload.random_requests(tok, 8, 10, 30, 16, seed=4)
    assert a == b and a != c
    for r in a:
        assert r.max_tokens == 16
        assert 10 <= r.prompt_len <= 30  # re-encoded length
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False))
    ids = workload.random_id_prompts(100, 5, 3, 6, seed=0)
    assert ids == workload.random_id_prompts(100, 5, 3, 6, seed=0)
    assert all(3 <= len(p) <= 6 and max(p) < 100 for p in ids)

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a b c", "max_tokens": 5}\n\n{"prompt": "d e"}\n{"prompt": "f"}\n')
    x = workload.file_requests(path, 2, 9, tok, seed=1)
    assert x == workload.file_requests(path, 2, 9, tok, seed=1) and len(x) == 2
    every = workload.file_requests(path, 5, 9, None)
    assert [r.max_tokens for r in every] == [5, 9, 9, 5, 9]


def test_bench_dtype_auto_is_the_engines_auto_on_this_cpu(monkeypatch):
    """serve_compare's `--dtype auto` gives both servers the dtype tpserve's auto picks: bfloat16
    only where the CPU has bf16 instructions (elsewhere bf16 matmuls are emulated), and an
    explicit dtype passes through unchanged."""
    from bench.online.serve_compare import concrete_dtype
    from workers import runtime

    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda *_: True)
    assert concrete_dtype("auto") == "bfloat16"
    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda *_: False)
    assert concrete_dtype("auto") == "float32"
    assert concrete_dtype("bfloat16") == "bfloat16"


def test_workloads_differ_between_levels_and_rounds():
    """No level or round repeats another's prompts (a prefix cache would answer them), and a
    level in a round is the same list for both servers (built once)."""
    from types import SimpleNamespace

    from bench.online.serve_compare import make_workloads

    tok = _tiny_tokenizer()
    args = SimpleNamespace(prompts_per_stream=1, input_len_min=10, input_len_max=30, output_len=8, seed=0)
    first, second = make_workloads(tok, [1, 16], args, 0), make_workloads(tok, [1, 16], args, 1)
    prompts = [[r.prompt for r in w[c]] for w in (first, second) for c in (1, 16)]
    assert all(len(p) == len(set(p)) for p in prompts)
    every = [p for level in prompts for p in level]
    assert len(set(every)) == len(every)
    assert [r.prompt for r in make_workloads(tok, [16], args, 1)[16]] == prompts[3]


def test_alternate_rounds_swaps_the_order_and_averages_each_level():
    from bench.online.serve_compare import alternate_rounds

    calls = []
    figures = iter([100.0, 50.0, 70.0, 150.0])  # tpserve 100, vllm 50 in round 0; vllm 70, tpserve 150 in round 1

    def run_levels(name, url, round_index):
        calls.append((name, round_index))
        value = next(figures)
        return {"16": {"output_token_throughput": value, "median_ttft_ms": value / 10, "median_tpot_ms": 1.0,
                       "completed": 4, "failed": 0}, "server_log": "x"}

    out = alternate_rounds({"tpserve": "t", "vllm": "v"}, 2, run_levels)
    assert calls == [("tpserve", 0), ("vllm", 0), ("vllm", 1), ("tpserve", 1)]
    assert out["tpserve"]["16"]["output_token_throughput"] == 125.0 and out["vllm"]["16"]["output_token_throughput"] == 60.0
    assert out["tpserve"]["16"]["median_ttft_ms"] == 12.5 and out["tpserve"]["16"]["completed"] == 8
    assert [r["16"]["output_token_throughput"] for r in out["vllm"]["rounds"]] == [50.0, 70.0]
    # A level one round did not complete is reported as such, not averaged.
    outcomes = iter([{"16": {"output_token_throughput": 9.0, "median_ttft_ms": 1.0, "median_tpot_ms": 1.0,
                             "completed": 4}}, {"16": {"completed": 0}}])
    broken = alternate_rounds({"tpserve": "t"}, 2, lambda name, url, r: next(outcomes))
    assert broken["tpserve"]["16"]["completed"] == 0 and "error" in broken["tpserve"]["16"]


def test_serve_compare_rounds_against_a_running_server(fake_server, tmp_path):
    """--rounds 2 against an already running server (the fake one), vLLM skipped: two rounds in
    the output and the level's mean, and exit status 0."""
    from bench.online import serve_compare

    _tiny_tokenizer().save_pretrained(tmp_path / "tok")
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = serve_compare.main(["--model-dir", str(tmp_path / "tok"), "--skip", "vllm", "--skip", "llamacpp",
                                 "--tpserve-base-url",
                                 fake_server, "--skip-offline", "--rounds", "2", "--pause-s", "0",
                                 "--concurrencies", "2", "--prompts-per-stream", "4", "--input-len-min", "5",
                                 "--input-len-max", "9", "--output-len", "2", "--dtype", "float32", "--ttft-curve", ""])
    assert rc == 0
    out = json.loads(buf.getvalue())
    assert len(out["tpserve"]["rounds"]) == 2 and out["tpserve"]["2"]["completed"] == 16
    assert out["tpserve"]["2"]["output_token_throughput"] > 0


def test_a_results_file_records_the_replica_s_load_time_kernel_choices(tmp_path):
    from bench.online.serve_compare import load_time_choices

    log = tmp_path / "tpserve.log"
    replica = "\x1b[36m(ServeReplica:tpserve:tpserve pid=20409)\x1b[0m INFO 2026-12-07 00:05:33,223 tpserve -- "
    log.write_text("\n".join([
        "2026-12-07 00:05:20,762\tINFO worker.py:2024 -- Started a local Ray instance.",
        replica + "tpserve CPU kernels: avx512_bf16 build",
        replica + "panel_linear takes bfloat16 pair-panel batches of every size, oneDNN none (rows: 4: 2.37 / 3.38)",
        replica + "KV cache: 5824 blocks x 16 tokens = 93184 tokens (2.00 GiB per rank)",
        replica + "greedy LM head: an int8 copy (28.5 MB) answers greedy batches of up to 2 rows first",
        replica + "Running: 15 reqs, Waiting: 0 reqs",
    ]))
    assert load_time_choices(log) == [
        "tpserve CPU kernels: avx512_bf16 build",
        "panel_linear takes bfloat16 pair-panel batches of every size, oneDNN none (rows: 4: 2.37 / 3.38)",
        "greedy LM head: an int8 copy (28.5 MB) answers greedy batches of up to 2 rows first",
    ]
    assert load_time_choices(tmp_path / "missing.log") == []


@requires_kernels
def test_the_choices_an_engine_logs_at_load_are_the_ones_collected(tmp_path, caplog):
    """The real log sites, not hand-written lines: a tiny engine built on the CPU kernels logs its
    panel and greedy-head choices under workers.load_choices' openings, and a replica log holding
    everything it logged gives back exactly those lines."""
    from bench.online.serve_compare import load_time_choices
    from workers import load_choices

    with caplog.at_level(logging.INFO, logger="workers"):
        make_engine(make_tiny_llama(tmp_path / "m", num_layers=2))
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("workers")]
    log = tmp_path / "tpserve.log"
    log.write_text("\n".join(f"(ServeReplica:tpserve:tpserve pid=1) INFO 2026-12-07 00:00:00,000 tpserve -- {m}"
                             for m in messages))
    collected = load_time_choices(log)
    assert [m for m in collected if m.startswith(load_choices.GREEDY_HEAD + ": an int8 copy")]
    if cpu_ops.ops().panel_linear_available():
        assert [m for m in collected if m.startswith(load_choices.PANEL_ROWS)]
    assert collected == [m for m in messages if m.startswith(load_choices.OPENINGS)]
