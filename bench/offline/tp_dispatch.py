"""Per-step dispatch overhead of the executors, as JSON.

    python -m bench.offline.tp_dispatch [--model PATH] [--steps 50] [--batch 4]

The default model is a random-weight Llama written on first use (8 heads / 4 KV heads so TP=2
divides it, 4 layers: short forwards keep the dispatch visible); any HF Llama folder works.

Overhead of a decode step = (time from "schedule done" to "outputs back" in the engine) minus
the slowest rank's own execute time (each rank times its WorkerCore.execute_model: input
preparation, forward, sampling on rank 0). Measured for TP=1 in-process, TP=1 in one actor and
TP=2 actors with each dispatch (gloo control group from the engine, Ray Compiled Graph, one
Ray call per rank), at 128- and 2048-token contexts: the SchedulerOutput carries deltas only, so the overhead
must not grow with the context. `empty_step_ms` is the round trip of a step with nothing
scheduled (pure dispatch, no forward).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Literal

import ray

from deployments.config import TpserveConfig
from deployments.engine.engine import LLMEngine, make_worker_config
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from scheduler.sampling_params import SamplingParams
from workers.executors.executor import Executor, ExecutorError, InProcessExecutor
from workers.model.config import ModelConfig
from workers.executors.ray_executor import RayExecutor

Dispatch = Literal["gloo", "compiled_graph", "remote"]

CONTEXTS = (128, 2048)
WARMUP_STEPS = 5


class BenchRayExecutor(RayExecutor):
    """RayExecutor with the dispatch modes the config cannot select, kept to measure against the
    default gloo control group: "compiled_graph" (a Ray Compiled Graph fanning the
    SchedulerOutput out over shared-memory channels; rank 0's output comes back) and "remote"
    (one Ray call per rank per step). "gloo" is the production path unchanged."""

    def __init__(self, *args, dispatch: Dispatch = "gloo", **kwargs) -> None:
        if dispatch not in ("gloo", "compiled_graph", "remote"):
            raise ValueError(f"unknown dispatch {dispatch!r}")
        super().__init__(*args, **kwargs)
        self.dispatch = dispatch
        self._dag = None

    def _start_dispatch(self) -> None:
        if self.dispatch == "gloo":
            super()._start_dispatch()
        elif self.dispatch == "compiled_graph":
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as scheduler_output:
                dag = MultiOutputNode([w.execute_model.bind(scheduler_output) for w in self.workers])
            self._dag = dag.experimental_compile(_max_inflight_executions=1)

    def _dispatch_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.dispatch == "gloo":
            return super()._dispatch_step(scheduler_output)
        try:
            if self.dispatch == "compiled_graph":
                return ray.get(self._dag.execute(scheduler_output), timeout=self.step_timeout_s)[0]
            return self._wait_step([w.execute_model.remote(scheduler_output) for w in self.workers])[0]
        except ExecutorError:
            raise
        except (ray.exceptions.RayChannelTimeoutError, ray.exceptions.GetTimeoutError):
            raise ExecutorError(self._timeout_message()) from None
        except Exception as exc:  # noqa: BLE001 - any failure of a rank ends the executor
            raise ExecutorError(self._failure_message(exc)) from exc

    def _wait_step(self, refs: list) -> list:
        """Results of `refs`; fails as soon as one fails, or after step_timeout_s."""
        deadline = time.monotonic() + self.step_timeout_s
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise ExecutorError(self._timeout_message())
            ray.get(ready[0])
        return ray.get(list(refs))

    def _release_dispatch(self, workers: list) -> None:
        if self._dag is not None:
            dag, self._dag = self._dag, None
            dag.teardown()
        super()._release_dispatch(workers)

    def _forget_dispatch(self) -> None:
        if self._dag is None:
            return
        # Its actors are gone: tearing down only frees the driver side (Ray logs the dead actors).
        dag, self._dag = self._dag, None
        dag_logger = logging.getLogger("ray.dag.compiled_dag_node")
        level = dag_logger.level
        dag_logger.setLevel(logging.CRITICAL)
        try:
            dag.teardown()
        except Exception:  # noqa: BLE001
            pass
        finally:
            dag_logger.setLevel(level)


class TimedExecutor(Executor):
    """Wraps an executor; records each step's wall time and the SchedulerOutput's pickled size."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.step_times: list[float] = []
        self.forward_times: list[float] = []
        self.payload_bytes: list[int] = []

    def load(self):
        return self.inner.load()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.inner.init_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        result = self.inner.execute_model(scheduler_output)
        self.step_times.append(time.perf_counter() - start)
        self.forward_times.append(result.forward_time)
        self.payload_bytes.append(len(pickle.dumps(scheduler_output)))
        return result

    def take_rank_times(self) -> list[list[float]] | None:
        take = getattr(self.inner, "take_forward_times", None)
        return take() if take is not None else None

    def reset(self) -> None:
        self.step_times.clear()
        self.forward_times.clear()
        self.payload_bytes.clear()
        self.take_rank_times()

    def check_health(self) -> None:
        self.inner.check_health()

    def shutdown(self) -> None:
        self.inner.shutdown()


def make_bench_model(folder: Path) -> str:
    """A random Llama with SmolLM2's tokenizer: 8 heads of 64, 4 KV heads, 4 layers, 4k positions."""
    if (folder / "config.json").exists():
        return str(folder)
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.model.default_model import ensure_default_model

    source = ensure_default_model()
    config = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                         max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(str(folder), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return str(folder)


def make_executor(kind: str, dispatch: str | None, config: TpserveConfig) -> Executor:
    model_config = ModelConfig.from_pretrained(config.model)
    worker_config = make_worker_config(config, model_config, config.max_model_len)
    if kind == "inprocess":
        return InProcessExecutor(worker_config)
    return BenchRayExecutor(worker_config, config.tensor_parallel_size, dispatch=dispatch)


def measure(engine: LLMEngine, timed: TimedExecutor, context: int, steps: int, batch: int) -> dict:
    rng = random.Random(context)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=WARMUP_STEPS + steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"ctx{context}-{i}", [rng.randrange(100, vocab) for _ in range(context)], params)
    # Prefill (not measured), then warm-up decodes.
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()
    timed.reset()
    for _ in range(steps):
        engine.step()
    wall = list(timed.step_times)
    rank_times = timed.take_rank_times()
    slowest = [max(times) for times in zip(*rank_times)] if rank_times else list(timed.forward_times)
    overhead = [w - f for w, f in zip(wall, slowest)]
    payload = statistics.median(timed.payload_bytes)
    while engine.has_unfinished_requests():
        engine.step()
    empty = []
    for _ in range(steps):
        start = time.perf_counter()
        timed.inner.execute_model(SchedulerOutput())
        empty.append(time.perf_counter() - start)
    ms = 1e3
    return {
        "context_tokens": context,
        "batch": batch,
        "steps": steps,
        "median_overhead_ms": round(statistics.median(overhead) * ms, 3),
        "p90_overhead_ms": round(sorted(overhead)[int(0.9 * len(overhead))] * ms, 3),
        "median_step_ms": round(statistics.median(wall) * ms, 3),
        "median_slowest_rank_ms": round(statistics.median(slowest) * ms, 3),
        "empty_step_ms": round(statistics.median(empty) * ms, 3),
        "scheduler_output_bytes": int(payload),
    }


def run_config(name: str, kind: str, tp: int, dispatch: str | None, args: argparse.Namespace) -> dict:
    config = TpserveConfig(model=args.model, tensor_parallel_size=tp, max_model_len=max(CONTEXTS) + 128,
                           max_num_batched_tokens=max(CONTEXTS) * args.batch, max_num_seqs=args.batch,
                           kv_cache_memory_gib=args.kv_cache_memory_gib, enable_prefix_caching=False)
    timed = TimedExecutor(make_executor(kind, dispatch, config))
    engine = LLMEngine(config, executor=timed)
    try:
        results = [measure(engine, timed, context, args.steps, args.batch) for context in CONTEXTS]
    finally:
        engine.shutdown()
    return {"name": name, "tensor_parallel_size": tp, "dispatch": dispatch or "in-process", "contexts": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF Llama folder (default: a random 8-head Llama)")
    parser.add_argument("--steps", type=int, default=50, help="measured decode steps per context")
    parser.add_argument("--batch", type=int, default=4, help="requests decoding together")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=0.5)
    parser.add_argument("--only", default=None, help="comma-separated config names to run")
    args = parser.parse_args()
    if args.model is None:
        from workers.model.default_model import cache_dir

        args.model = make_bench_model(cache_dir() / "bench-llama-h8-kv4")

    import ray

    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING")
    configs = [
        ("tp1_inprocess", "inprocess", 1, None),
        ("tp1_actor_gloo", "ray", 1, "gloo"),
        ("tp1_actor_compiled_graph", "ray", 1, "compiled_graph"),
        ("tp1_actor_remote", "ray", 1, "remote"),
        ("tp2_gloo", "ray", 2, "gloo"),
        ("tp2_compiled_graph", "ray", 2, "compiled_graph"),
        ("tp2_remote", "ray", 2, "remote"),
    ]
    if args.only:
        wanted = set(args.only.split(","))
        configs = [c for c in configs if c[0] in wanted]
    try:
        results = [run_config(*config, args) for config in configs]
    finally:
        ray.shutdown()
    print(json.dumps({
        "model": args.model,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "definition": "overhead = step wall time (schedule done -> outputs back) - slowest rank's execute time",
        "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
