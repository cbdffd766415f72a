"""Time to first token as the prompt grows: one request at a time, prompts of exact token lengths
(default 1k, 4k and 6k tokens), greedy, a few output tokens with ignore_eos. Per length: TTFT p50 and
the decode TPOT at that context (the same requests' later tokens), and tpserve / peer ratios.

serve_compare runs it last (`--ttft-curve 1024,4096,6144`, `''` to skip) on a server started for it
with room for the longest prompt and its output. Every request is a prompt the server has not seen:
each (length, repeat) has its own seeded text of random word tokens (bench.workload.exact_length_text),
so no prefix cache shortens a prefill; the warm-up request has text of its own too. Every server gets
the same prompts, and the lengths are interleaved (1k, 4k, 6k, 1k, ...) so that a drift in the
machine's speed spreads over all lengths rather than landing on one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.online.serve_load import LoadConfig, RequestResult, fetch_model, one_request, percentile, request_tpot
from bench.online.sse_client import StreamingClient
from bench.workload import BenchRequest, exact_length_text, word_token_ids

# Seeds of the curve's texts: far from serve_compare's level seeds (seed + 1000 x streams + ...).
CURVE_SEED_BASE = 500_000_000
WARMUP_SEED = CURVE_SEED_BASE - 1


@dataclass(frozen=True)
class CurveSpec:
    # Prompt lengths in tokens, as the served model's tokenizer counts them.
    lengths: tuple[int, ...]
    # Requests per length (each a fresh prompt).
    repeats: int
    # Output tokens per request (ignore_eos: exactly this many); TPOT is measured over them.
    output_len: int
    # The run's seed (serve_compare's --seed): the same seed gives every server the same prompts.
    seed: int
    # Cap on one request, seconds.
    request_timeout_s: float = 600.0

    @property
    def max_model_len(self) -> int:
        """The context a server needs for the curve: the longest prompt and its output."""
        return max(self.lengths) + self.output_len


@dataclass(frozen=True)
class CurvePrompt:
    # Target length in tokens.
    length: int
    # Which repeat of that length (0-based).
    repeat: int
    # The request; prompt_len is 0 so a result's prompt_tokens is the server's own count (0: not reported).
    request: BenchRequest


def parse_lengths(text: str) -> tuple[int, ...]:
    """`--ttft-curve` "1024,4096,6144" -> (1024, 4096, 6144); "" -> () (no curve)."""
    lengths = tuple(int(part) for part in text.split(",") if part.strip())
    if any(n < 1 for n in lengths):
        raise ValueError(f"prompt lengths must be positive: {text!r}")
    return lengths


def curve_prompts(tokenizer, spec: CurveSpec) -> tuple[BenchRequest, list[CurvePrompt]]:
    """The warm-up request and the curve's requests, in the order they are sent."""
    words = word_token_ids(tokenizer)

    def text(length: int, seed: int) -> str:
        return exact_length_text(tokenizer, words, length, seed)

    # The warm-up is the longest length: any one-off cost of a long prefill (a first chunk shape,
    # a pool's growth) is paid before timing starts.
    warmup = BenchRequest(text(max(spec.lengths), spec.seed + WARMUP_SEED), 0, 4)
    prompts = [CurvePrompt(length, r, BenchRequest(text(length, spec.seed + CURVE_SEED_BASE + 100 * length + r),
                                                   0, spec.output_len))
               for r in range(spec.repeats) for length in spec.lengths]
    return warmup, prompts


async def run_curve(base_url: str, warmup: BenchRequest, prompts: list[CurvePrompt], spec: CurveSpec) -> dict:
    """Send the warm-up, then every prompt one at a time; the per-length summary."""
    cfg = LoadConfig(base_url=base_url.rstrip("/").removesuffix("/v1"), ignore_eos=True,
                     request_timeout_s=spec.request_timeout_s)
    async with StreamingClient(cfg.base_url) as client:
        model = await fetch_model(client)
        first = await one_request(client, cfg, model, warmup)
        if not first.ok:
            raise RuntimeError(f"curve warm-up request failed: {first.error}")
        results = [(p, await one_request(client, cfg, model, p.request)) for p in prompts]
    return summarize_curve(results, spec)


def summarize_curve(results: list[tuple[CurvePrompt, RequestResult]], spec: CurveSpec) -> dict:
    """Per length: TTFT and TPOT p50 and every value, the prompt tokens the server counted, failures."""
    out: dict = {"output_len": spec.output_len, "repeats": spec.repeats}
    for length in spec.lengths:
        runs = [r for p, r in results if p.length == length]
        ok = [r for r in runs if r.ok]
        ttft = [r.ttft * 1e3 for r in ok]
        tpot = [request_tpot(r) * 1e3 for r in ok if r.output_tokens > 1]
        level = {"completed": len(ok), "failed": len(runs) - len(ok),
                 "median_ttft_ms": round(percentile(ttft, 50), 3) if ttft else None,
                 "median_tpot_ms": round(percentile(tpot, 50), 3) if tpot else None,
                 "ttft_ms": [round(v, 3) for v in ttft], "tpot_ms": [round(v, 3) for v in tpot],
                 "output_tokens": [r.output_tokens for r in ok],
                 # The server's own count (usage.prompt_tokens); 0 where it reported none.
                 "server_prompt_tokens": sorted({r.prompt_tokens for r in ok})}
        errors = sorted({r.error for r in runs if not r.ok})
        if errors:
            level["errors"] = errors[:3]
        out[str(length)] = level
    return out


def curve_ratios(ours: dict, peer: dict) -> dict:
    """tpserve / a peer per prompt length: below 1 favours tpserve (TTFT and TPOT alike)."""
    out = {}
    for length, level in ours.items():
        if not length.isdigit() or not isinstance(peer.get(length), dict):
            continue
        out[length] = {key: _ratio(level.get(key), peer[length].get(key)) for key in ("median_ttft_ms", "median_tpot_ms")}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b and math.isfinite(a / b) else None
