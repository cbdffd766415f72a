"""Decode cost of structured output: the same batch with and without constrained requests.

    python -m bench.structured_output_cost [--batch 16] [--constrained 8] [--output-len 64]

Runs the engine (default model) on `batch` requests of one chat prompt, greedy: once with every
request free, once with `constrained` of them under a json_schema response_format (bounded, so
they keep decoding through the whole run), in two passes each, the first pass as warm-up. Prints
output tokens/s of each and the engine time spent in the grammar hooks (bitmask fill before the
step, matcher advance after) per step. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

from deployments.config import TpserveConfig
from deployments.engine.engine import LLMEngine
from scheduler.sampling_params import SamplingParams, StructuredOutputSpec

# Long enough to keep a constrained request decoding for the whole run: a list of bounded ints.
SCHEMA = {"type": "object", "properties": {"values": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 200}},
    "required": ["values"]}


class HookTimer:
    """Wraps the engine's grammar hooks and sums their wall time."""

    def __init__(self, manager) -> None:
        self.seconds = 0.0
        for name in ("attach_bitmasks", "advance"):
            setattr(manager, name, self._timed(getattr(manager, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper


def run(engine: LLMEngine, prompt: list[int], batch: int, constrained: int, output_len: int) -> dict:
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))
    for i in range(batch):
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                                structured_output=spec if i < constrained else None)
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    steps, tokens = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        tokens += engine.last_iteration.num_generation_tokens
    elapsed = time.perf_counter() - start
    return {"output_tokens": tokens, "steps": steps, "seconds": round(elapsed, 2),
            "output_tokens_per_s": round(tokens / elapsed, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--constrained", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    engine = LLMEngine(TpserveConfig(dtype=args.dtype, enable_prefix_caching=False))
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "List numbers as JSON."}],
                                                add_generation_prompt=True, tokenize=False)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    timer = HookTimer(engine.structured_output)
    result = {"batch": args.batch, "constrained": args.constrained, "output_len": args.output_len, "dtype": args.dtype}
    for label, constrained in (("free", 0), ("mixed", args.constrained)):
        run(engine, prompt, args.batch, constrained, args.output_len)  # warm-up pass
        timer.seconds = 0.0
        result[label] = run(engine, prompt, args.batch, constrained, args.output_len)
        result[label]["grammar_ms_per_step"] = round(1000 * timer.seconds / result[label]["steps"], 3)
    result["mixed_over_free_throughput"] = round(
        result["mixed"]["output_tokens_per_s"] / result["free"]["output_tokens_per_s"], 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
