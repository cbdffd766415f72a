"""The single-stream weight-read floor: bytes of weights one decode token reads / the machine's read
bandwidth. A decode step at one stream reads every weight once, so no server can emit a token faster
than memory delivers those bytes; serve_compare prints each server's 1-stream TPOT beside it.

    python -m bench.online.weight_read_floor [MODEL_DIR] [--dtype bfloat16]   # bytes, bandwidth, floor

Bytes per token come from the model's HF config.json: every projection and norm of every layer, the
final norm and the LM head (tied embeddings are read once, as the LM head), plus the one embedding
row the token looks up. The bandwidth is a plain torch sum over a buffer as large as those weights,
on as many threads as the servers use, best of several runs, in a subprocess of its own so that it
shares no threads or allocator state with the benchmark that asks for it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}
# Families whose layers carry two extra norms around the MLP (pre- and post-feedforward).
FOUR_NORM_FAMILIES = frozenset({"gemma2", "gemma3", "gemma3_text"})
# Families with an RMSNorm over each query and key head (head_dim weights each).
QK_NORM_FAMILIES = frozenset({"qwen3", "gemma3", "gemma3_text"})
# Families with a bias on q/k/v whatever the config says (and none on o_proj).
QKV_BIAS_FAMILIES = frozenset({"qwen2"})
SUPPORTED_FAMILIES = frozenset({"llama", "mistral", "qwen2"}) | FOUR_NORM_FAMILIES | QK_NORM_FAMILIES


@dataclass(frozen=True)
class DecodeWeightReads:
    # The config's model_type (a family whose layer shapes this module knows).
    model_type: str
    # Weights of the decoder layers, all of them: projections, their biases, the norms.
    layer_params: int
    # The final norm and the LM head matrix (for tied embeddings: the embedding matrix, read once).
    head_params: int
    # The one embedding row the decoded token looks up.
    embedding_row_params: int
    # Bytes of one weight in the served dtype.
    bytes_per_param: int

    @property
    def params_per_token(self) -> int:
        return self.layer_params + self.head_params + self.embedding_row_params

    @property
    def bytes_per_token(self) -> int:
        return self.params_per_token * self.bytes_per_param


def text_config(config: dict) -> dict:
    """The language model's part of a config (multimodal configs nest it under text_config)."""
    return config.get("text_config") or config


def layer_params(cfg: dict) -> int:
    """Weights of one decoder layer of a dense Llama-family model, from its config fields."""
    family = cfg["model_type"]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    params = hidden * (q_out + 2 * kv_out) + q_out * hidden  # q, k, v, o
    if family in QKV_BIAS_FAMILIES:
        params += q_out + 2 * kv_out
    elif cfg.get("attention_bias"):
        params += q_out + 2 * kv_out + hidden
    params += 3 * hidden * inter  # gate, up, down
    if cfg.get("mlp_bias"):
        params += 2 * inter + hidden
    params += (4 if family in FOUR_NORM_FAMILIES else 2) * hidden
    if family in QK_NORM_FAMILIES:
        params += 2 * head_dim
    return params


def decode_weight_reads(config: dict, dtype: str) -> DecodeWeightReads:
    """What one decode token reads of a model with HF config `config` served in `dtype`."""
    cfg = text_config(config)
    if cfg.get("model_type") not in SUPPORTED_FAMILIES:
        raise ValueError(f"no weight count for model_type {cfg.get('model_type')!r}; one of {sorted(SUPPORTED_FAMILIES)}")
    if dtype not in BYTES_PER_PARAM:
        raise ValueError(f"no byte size for dtype {dtype!r}; one of {sorted(BYTES_PER_PARAM)}")
    hidden = cfg["hidden_size"]
    return DecodeWeightReads(model_type=cfg["model_type"], layer_params=cfg["num_hidden_layers"] * layer_params(cfg),
                             head_params=hidden + cfg["vocab_size"] * hidden, embedding_row_params=hidden,
                             bytes_per_param=BYTES_PER_PARAM[dtype])


def last_level_cache_bytes() -> int:
    """The largest cache cpu0 reports in sysfs (0 when it reports none)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


@dataclass(frozen=True)
class ReadBandwidth:
    # Bytes summed per run (the buffer's size).
    buffer_bytes: int
    # Threads torch summed on (the servers' thread count: every CPU this process may use).
    threads: int
    # Timed runs after one untimed warm-up pass; the bandwidth is the best of them.
    runs: int
    # buffer_bytes / the fastest run's seconds, in GB/s (1e9 bytes).
    best_gbps: float
    # buffer_bytes / the median run's seconds, in GB/s: how far the best stands from typical.
    median_gbps: float


def time_sums(buffer_bytes: int, threads: int, runs: int) -> ReadBandwidth:
    """Sum a float32 buffer of buffer_bytes `runs` times on `threads` threads (in this process)."""
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(buffer_bytes // 4, dtype=torch.float32)  # written once: its pages are mapped before timing
    buf.sum()  # warm-up: thread pool up, buffer's TLB entries touched
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        buf.sum()
        seconds.append(time.perf_counter() - start)
    seconds.sort()
    return ReadBandwidth(buffer_bytes=buf.numel() * 4, threads=threads, runs=runs,
                         best_gbps=round(buf.numel() * 4 / seconds[0] / 1e9, 3),
                         median_gbps=round(buf.numel() * 4 / seconds[len(seconds) // 2] / 1e9, 3))


def measure_read_bandwidth(buffer_bytes: int, threads: int | None = None, runs: int = 10,
                           timeout_s: float = 300.0) -> ReadBandwidth:
    """time_sums in a fresh python process (its own threads and allocator), returned here."""
    threads = threads or len(os.sched_getaffinity(0))
    cmd = [sys.executable, "-m", "bench.online.weight_read_floor", "--bandwidth-only", "--buffer-bytes",
           str(buffer_bytes), "--threads", str(threads), "--runs", str(runs)]
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=repo, env=env, check=True)
    return ReadBandwidth(**json.loads(proc.stdout))


@dataclass(frozen=True)
class WeightReadFloor:
    # What one decode token reads, in bytes (DecodeWeightReads.bytes_per_token).
    bytes_per_token: int
    # The bandwidth measured on a buffer of bytes_per_token (GB/s, best run).
    read_gbps: float
    # bytes_per_token / read_gbps: the fastest a single stream can decode, in ms per token.
    floor_ms: float
    # The last-level cache cpu0 reports; a buffer smaller than it may be measured partly from cache.
    llc_bytes: int
    # The bandwidth's full measurement.
    bandwidth: dict
    # Where the weights are no larger than twice the LLC: the floor from a buffer of twice the LLC
    # (memory, not cache, bandwidth), the ceiling a server could see were its weights never cached.
    # None where the weights' own buffer already exceeds it.
    beyond_llc_floor_ms: float | None = None


def weight_read_floor(bytes_per_token: int, threads: int | None = None, runs: int = 10) -> WeightReadFloor:
    """Measure the read bandwidth now (on a buffer of the weights' size) and the floor it gives."""
    llc = last_level_cache_bytes()
    bandwidth = measure_read_bandwidth(bytes_per_token, threads, runs)
    beyond = measure_read_bandwidth(2 * llc, threads, runs) if bytes_per_token <= 2 * llc else None
    return WeightReadFloor(bytes_per_token=bytes_per_token, read_gbps=bandwidth.best_gbps,
                           floor_ms=_ms(bytes_per_token, bandwidth.best_gbps), llc_bytes=llc,
                           bandwidth=asdict(bandwidth),
                           beyond_llc_floor_ms=_ms(bytes_per_token, beyond.best_gbps) if beyond else None)


def _ms(nbytes: int, gbps: float) -> float:
    return round(nbytes / (gbps * 1e9) * 1e3, 3)


def floor_report(floor: WeightReadFloor, median_tpot_ms: float | None, after: WeightReadFloor | None = None) -> dict:
    """What serve_compare prints beside a server's 1-stream level: its TPOT p50, the floor, their ratio.

    `floor` is measured right before the level, `after` (if given) right after it. A VM's read
    bandwidth can move by half within minutes (a 2-core EPYC Zen 4 read 49 GB/s before one
    server's level and 33 before the next one's, in one `make bench-serve`), so one measurement
    can be far from what the level ran at: the floor the ratio uses is then the mean of the two,
    and both stay in the report (their spread says how far the machine drifted while the level
    ran)."""
    floors = [floor] + ([after] if after is not None else [])
    floor_ms = round(sum(f.floor_ms for f in floors) / len(floors), 3)
    out = {"median_tpot_ms": median_tpot_ms, "floor_ms": floor_ms, "read_gbps": floor.read_gbps,
           "bytes_per_token": floor.bytes_per_token, "llc_bytes": floor.llc_bytes, "bandwidth": floor.bandwidth,
           "beyond_llc_floor_ms": floor.beyond_llc_floor_ms}
    if after is not None:
        out |= {"floor_ms_before": floor.floor_ms, "floor_ms_after": after.floor_ms, "read_gbps_after": after.read_gbps}
    out["tpot_over_floor"] = round(median_tpot_ms / floor_ms, 3) if median_tpot_ms else None
    return out


def model_weight_reads(model_dir: str | Path, dtype: str) -> DecodeWeightReads:
    return decode_weight_reads(json.loads((Path(model_dir) / "config.json").read_text()), dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", default=None, help="HF folder (default: tpserve's default model)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(BYTES_PER_PARAM))
    p.add_argument("--threads", type=int, default=None, help="default: every CPU this process may use")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--bandwidth-only", action="store_true", help="only time the sums here (the subprocess's part)")
    p.add_argument("--buffer-bytes", type=int, default=0, help="with --bandwidth-only: the buffer's size")
    a = p.parse_args(argv)
    if a.bandwidth_only:
        print(json.dumps(asdict(time_sums(a.buffer_bytes, a.threads or len(os.sched_getaffinity(0)), a.runs))))
        return 0
    if a.model_dir is None:
        from workers.model.default_model import ensure_default_model

        a.model_dir = ensure_default_model()
    reads = model_weight_reads(a.model_dir, a.dtype)
    floor = weight_read_floor(reads.bytes_per_token, a.threads, a.runs)
    print(json.dumps({"weights": asdict(reads) | {"params_per_token": reads.params_per_token},
                      "floor": asdict(floor)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
