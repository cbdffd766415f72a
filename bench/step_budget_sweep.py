"""In-process closed-loop sweep of the scheduler's step token budget (no Ray, no HTTP).

N streams each keep one request in one engine; when a request finishes, its stream submits the
next prompt, as `bench.serve_compare`'s clients do. Budget settings are alternated round by round
on the same engine (same weights, same KV cache), so that a drift of the machine hits all of them
alike. Prints one JSON object: per setting and stream count, output tok/s and the median TTFT
(from `add_request` to the step that returned the first token) of every round.

    python -m bench.step_budget_sweep [--streams 16,64] [--rounds 2] \
        [--setting 32:512:2048] [--setting 0:0:1024] ...

A setting is `per_request:min:max` (Scheduler.step_token_budget); `0:0:N` is a fixed budget N.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from bench.workload import random_id_prompts
from deployments.config import TpserveConfig
from deployments.engine.engine import LLMEngine
from scheduler.sampling_params import SamplingParams
from workers.runtime import resolve_dtype


@dataclasses.dataclass(frozen=True)
class BudgetSetting:
    # Tokens of budget per request in the engine (0: always `maximum`).
    per_request: int
    # Floor of the budget.
    minimum: int
    # Cap of the budget (max_num_batched_tokens).
    maximum: int

    @classmethod
    def parse(cls, text: str) -> "BudgetSetting":
        per_request, minimum, maximum = (int(x) for x in text.split(":"))
        return cls(per_request, minimum, maximum)

    def label(self) -> str:
        if self.per_request == 0:
            return f"fixed {self.maximum}"
        return f"{self.per_request} x requests, {self.minimum}..{self.maximum}"


def apply_setting(engine: LLMEngine, setting: BudgetSetting) -> None:
    """The scheduler reads its (frozen) config at every step, so a replaced one takes effect at once."""
    engine.scheduler.config = dataclasses.replace(
        engine.scheduler.config, num_batched_tokens_per_request=setting.per_request,
        min_num_batched_tokens=setting.minimum, max_num_batched_tokens=setting.maximum)


def closed_loop(engine: LLMEngine, prompts: list[list[int]], streams: int, output_len: int) -> dict:
    """Runs `prompts` with at most `streams` in flight; returns tok/s and the median TTFT."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    added_at: dict[str, float] = {}
    ttfts: list[float] = []
    num_tokens = 0

    def submit() -> None:
        index, prompt = pending.pop(0)
        request_id = f"p{index}"
        added_at[request_id] = time.perf_counter()
        engine.add_request(request_id, prompt, params)

    start = time.perf_counter()
    for _ in range(min(streams, len(pending))):
        submit()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and out.num_output_tokens == len(out.new_token_ids):
                ttfts.append(now - added_at[out.request_id])
            num_tokens += len(out.new_token_ids)
            if out.finished and pending:
                submit()
    elapsed = time.perf_counter() - start
    return {"output_tokens_per_s": round(num_tokens / elapsed, 2),
            "median_ttft_ms": round(1000 * statistics.median(ttfts), 1), "seconds": round(elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="16,64", help="comma-separated stream counts")
    parser.add_argument("--prompts-per-stream", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--setting", action="append", default=[], help="per_request:min:max (repeat)")
    parser.add_argument("--input-len", type=int, nargs=2, default=(64, 512))
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = [BudgetSetting.parse(s) for s in (args.setting or ["32:512:2048", "0:0:1024"])]

    config = TpserveConfig(dtype=args.dtype, max_num_batched_tokens=max(s.maximum for s in settings),
                           enable_prefix_caching=False)
    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    closed_loop(engine, random_id_prompts(vocab, 8, *args.input_len, seed=args.seed + 1), 8, 8)  # warm-up
    result: dict = {"dtype": str(resolve_dtype(args.dtype, "cpu")), "torch_threads": torch.get_num_threads(), "rounds": args.rounds, "levels": {}}
    for streams in (int(s) for s in args.streams.split(",")):
        prompts = random_id_prompts(vocab, max(1, round(args.prompts_per_stream * streams)), *args.input_len,
                                    seed=args.seed)
        level: dict[str, list[dict]] = {s.label(): [] for s in settings}
        for round_index in range(args.rounds):
            # Alternate the order each round so that no setting always runs first.
            order = settings if round_index % 2 == 0 else list(reversed(settings))
            for setting in order:
                apply_setting(engine, setting)
                level[setting.label()].append(closed_loop(engine, prompts, streams, args.output_len))
                print(json.dumps({"streams": streams, "setting": setting.label(), **level[setting.label()][-1]}),
                      flush=True)
        result["levels"][str(streams)] = level
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
