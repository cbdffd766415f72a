"""vLLM's offline `LLM.generate` on a workload file: run by the vLLM venv's python, not tpserve's.

    <vllm-venv>/bin/python bench/offline/vllm_offline.py WORKLOAD.json --dtype float32 --max-model-len 2048

WORKLOAD.json: {"model": DIR, "requests": [{"prompt_token_ids": [...], "max_tokens": N}, ...]}.
Greedy, ignore_eos, so every request produces exactly max_tokens. A warm-up pass over the first
requests precedes the timed pass (as tpserve's offline bench does). Prints one JSON object.
This file imports nothing of tpserve: the vLLM venv does not have it.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workload")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--warmup", type=int, default=16)
    args = p.parse_args()
    with open(args.workload) as f:
        workload = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=workload["model"], dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, seed=0)
    reqs = workload["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    llm.generate(prompts[: args.warmup], params[: args.warmup], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("VLLM_OFFLINE_RESULT " + json.dumps({
        "output_tokens": tokens, "seconds": round(elapsed, 2), "output_tokens_per_s": round(tokens / elapsed, 2),
    }))


if __name__ == "__main__":
    main()
