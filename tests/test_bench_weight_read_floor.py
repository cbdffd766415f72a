"""The single-stream weight-read floor: bytes one decode token reads, counted from config.json and
checked against the parameters transformers itself builds for that config (on the meta device,
so no weights are allocated); the bandwidth measured in a subprocess; serve_compare measuring it
right before and right after the 1-stream level and printing TPOT beside their mean."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from family_models import FAMILIES, _config, _model_class
from test_bench_serve_load import fake_server  # noqa: F401 (the fixture: a tiny OpenAI-style SSE server)

from bench.online import serve_compare, weight_read_floor
from bench.online.weight_read_floor import decode_weight_reads
from bench.workload import BenchRequest
from workers.model.default_model import ensure_default_model


def params_one_token_reads(model, hidden: int) -> int:
    """The reference count, from the model's own parameters: every weight once (a tied LM head is
    the embedding matrix, counted once by parameters()), except that an untied embedding matrix is
    not read whole: the token looks up one row of it."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    return total + hidden - (0 if tied else embedding.numel())


def meta_model(model_class, config):
    with torch.device("meta"):
        return model_class(config)


def _llama_variant(**overrides):
    import transformers as tf

    base = json.loads((ensure_default_model() / "config.json").read_text())
    base |= overrides
    return tf.LlamaConfig(**{k: v for k, v in base.items() if k not in ("architectures", "model_type")})


@pytest.mark.parametrize("family", FAMILIES)
def test_bytes_per_token_match_the_family_models_parameters(family):
    config = _config(family)
    model = meta_model(_model_class(family), config)
    reads = decode_weight_reads(config.to_dict(), "bfloat16")
    assert reads.params_per_token == params_one_token_reads(model, config.hidden_size)
    assert reads.bytes_per_token == 2 * reads.params_per_token


def test_the_served_models_count_from_its_config_json():
    """SmolLM2-135M as served (tied embeddings), and Llama variants with biases and an untied head."""
    import transformers as tf

    model_dir = ensure_default_model()
    config = tf.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    reads = weight_read_floor.model_weight_reads(model_dir, "float32")
    assert reads.params_per_token == params_one_token_reads(meta_model(tf.LlamaForCausalLM, config), config.hidden_size)
    assert reads.bytes_per_token == 4 * reads.params_per_token
    for variant in (_llama_variant(tie_word_embeddings=False), _llama_variant(attention_bias=True, mlp_bias=True)):
        expected = params_one_token_reads(meta_model(tf.LlamaForCausalLM, variant), variant.hidden_size)
        assert decode_weight_reads(variant.to_dict(), "float32").params_per_token == expected


def test_unknown_family_or_dtype_is_refused():
    config = _config("qwen2").to_dict()
    with pytest.raises(ValueError, match="model_type"):
        decode_weight_reads(config | {"model_type": "mixtral"}, "float32")
    with pytest.raises(ValueError, match="dtype"):
        decode_weight_reads(config, "int8")


def test_bandwidth_is_measured_in_a_subprocess_on_the_asked_buffer_and_threads():
    bw = weight_read_floor.measure_read_bandwidth(32 << 20, threads=1, runs=3)
    assert bw.buffer_bytes == 32 << 20 and bw.threads == 1 and bw.runs == 3
    # Any real machine reads between 100 MB/s and 10 TB/s; best is the fastest run.
    assert 0.1 < bw.median_gbps <= bw.best_gbps < 10_000


def test_floor_is_bytes_over_bandwidth(monkeypatch):
    """200 MB at 20 GB/s is 10 ms a token; a 25 ms TPOT is 2.5 floors."""
    measured = weight_read_floor.ReadBandwidth(buffer_bytes=200_000_000, threads=2, runs=3, best_gbps=20.0,
                                               median_gbps=18.0)
    monkeypatch.setattr(weight_read_floor, "measure_read_bandwidth", lambda *a, **k: measured)
    monkeypatch.setattr(weight_read_floor, "last_level_cache_bytes", lambda: 32 << 20)
    floor = weight_read_floor.weight_read_floor(200_000_000)
    assert floor.floor_ms == 10.0 and floor.read_gbps == 20.0 and floor.beyond_llc_floor_ms is None
    report = weight_read_floor.floor_report(floor, 25.0)
    assert report["median_tpot_ms"] == 25.0 and report["floor_ms"] == 10.0 and report["tpot_over_floor"] == 2.5
    assert weight_read_floor.floor_report(floor, None)["tpot_over_floor"] is None
    # Measured again after the level at 40 GB/s (5 ms): the ratio is over the mean floor, both kept.
    faster = weight_read_floor.WeightReadFloor(bytes_per_token=200_000_000, read_gbps=40.0, floor_ms=5.0,
                                               llc_bytes=32 << 20, bandwidth={})
    bracketed = weight_read_floor.floor_report(floor, 25.0, faster)
    assert bracketed["floor_ms"] == 7.5 and bracketed["tpot_over_floor"] == round(25.0 / 7.5, 3)
    assert (bracketed["floor_ms_before"], bracketed["floor_ms_after"]) == (10.0, 5.0)
    # Weights within twice the LLC: a second buffer past it gives the memory-bandwidth floor too.
    monkeypatch.setattr(weight_read_floor, "last_level_cache_bytes", lambda: 480 << 20)
    assert weight_read_floor.weight_read_floor(200_000_000).beyond_llc_floor_ms == 10.0


class _Server:
    def __init__(self, url, log):
        self.base_url, self.log, self.log_path = url, log, "/tmp/fake.log"

    def stop(self):
        self.log.append("stop")


def test_serve_compare_measures_the_floor_right_before_and_after_the_one_stream_level(fake_server, monkeypatch):
    log: list = []
    # The machine drifts while the level runs: 2 ms before it, 3 ms after it.
    floors = iter([weight_read_floor.WeightReadFloor(bytes_per_token=10**8, read_gbps=gbps, floor_ms=ms, llc_bytes=0,
                                                     bandwidth={}) for gbps, ms in ((50.0, 2.0), (33.3, 3.0))])
    real_load = serve_compare.load_level

    def load(url, concurrency, *rest):
        log.append(f"load {concurrency}")
        return real_load(url, concurrency, *rest)

    def measure(nbytes):
        log.append(f"floor {nbytes}")
        return next(floors)

    monkeypatch.setattr(serve_compare, "load_level", load)
    monkeypatch.setattr(serve_compare, "weight_read_floor", measure)
    args = argparse.Namespace(client="tpserve", request_rate=math.inf, seed=0, max_duration=30, goodput_ttft_ms=1e3,
                              goodput_tpot_ms=100.0, weight_bytes_per_token=10**8)
    workloads = {4: [BenchRequest(f"b{i}", 3, 3) for i in range(4)], 1: [BenchRequest(f"a{i}", 3, 3) for i in range(2)]}
    out = serve_compare.bench_one("vllm", lambda streams: _Server(fake_server, log), None, workloads, args)
    assert log == ["load 4", f"floor {10**8}", "load 1", f"floor {10**8}", "stop"]
    one = out["1"]["weight_read_floor"]
    assert one["floor_ms"] == 2.5 and one["median_tpot_ms"] == out["1"]["median_tpot_ms"]
    assert (one["floor_ms_before"], one["floor_ms_after"]) == (2.0, 3.0)
    assert one["tpot_over_floor"] == round(out["1"]["median_tpot_ms"] / 2.5, 3)
    assert "weight_read_floor" not in out["4"]
    assert serve_compare.single_stream_floor({"vllm": out}) == {
        "vllm": {"median_tpot_ms": one["median_tpot_ms"], "floor_ms": 2.5, "tpot_over_floor": one["tpot_over_floor"]}}


def test_rounds_average_the_floor_and_divide_the_mean_tpot_by_it():
    figures = iter([(40.0, 2.0), (60.0, 3.0)])

    def run_levels(name, url, r):
        tpot, floor_ms = next(figures)
        return {"1": {"output_token_throughput": 10.0, "median_ttft_ms": 5.0, "median_tpot_ms": tpot, "completed": 8,
                      "weight_read_floor": {"floor_ms": floor_ms}}}

    out = serve_compare.alternate_rounds({"tpserve": "t"}, 2, run_levels)
    assert out["tpserve"]["1"]["weight_read_floor"] == {"median_tpot_ms": 50.0, "floor_ms": 2.5,
                                                        "floor_ms_per_round": [2.0, 3.0], "tpot_over_floor": 20.0}


def test_a_failed_bandwidth_run_leaves_the_level_measured(fake_server, monkeypatch):
    import subprocess

    def broken(nbytes):
        raise subprocess.CalledProcessError(1, ["python"], stderr="killed")

    monkeypatch.setattr(serve_compare, "weight_read_floor", broken)
    args = argparse.Namespace(client="tpserve", request_rate=math.inf, seed=0, max_duration=30, goodput_ttft_ms=1e3,
                              goodput_tpot_ms=100.0, weight_bytes_per_token=10**8)
    out = serve_compare.load_level_with_floor(fake_server, 1, [BenchRequest("a", 3, 2), BenchRequest("b", 3, 2)], args, 0)
    assert out["completed"] == 2 and "error" in out["weight_read_floor"]


def test_a_failed_bandwidth_run_after_the_level_keeps_the_floor_before_it(fake_server, monkeypatch):
    import subprocess

    before = weight_read_floor.WeightReadFloor(bytes_per_token=10**8, read_gbps=50.0, floor_ms=2.0, llc_bytes=0,
                                               bandwidth={})
    calls = iter([before])

    def measure(nbytes):
        try:
            return next(calls)
        except StopIteration:
            raise subprocess.CalledProcessError(1, ["python"], stderr="killed") from None

    monkeypatch.setattr(serve_compare, "weight_read_floor", measure)
    args = argparse.Namespace(client="tpserve", request_rate=math.inf, seed=0, max_duration=30, goodput_ttft_ms=1e3,
                              goodput_tpot_ms=100.0, weight_bytes_per_token=10**8)
    out = serve_compare.load_level_with_floor(fake_server, 1, [BenchRequest("a", 3, 2), BenchRequest("b", 3, 2)], args, 0)
    assert out["completed"] == 2 and out["weight_read_floor"]["floor_ms"] == 2.0
    assert "floor_ms_after" not in out["weight_read_floor"]
