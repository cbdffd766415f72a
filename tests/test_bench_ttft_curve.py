"""The TTFT curve: prompts of exact token lengths that share no prefix, sent one at a time to a fake
server whose first-token delay grows with the prompt, and serve_compare starting each server for
the curve with room for the longest prompt (llama.cpp with one slot)."""

from __future__ import annotations

import asyncio
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from test_bench_serve_load import _tiny_tokenizer

from asgi_server import serve_asgi
from bench.online import serve_compare, ttft_curve
from bench.online.ttft_curve import CurveSpec
from bench.workload import exact_length_text, load_tokenizer, word_token_ids
from workers.model.default_model import ensure_default_model

MS_PER_WORD = 0.5  # the fake server's prefill: this long per prompt word before the first chunk
GAP_S = 0.02  # and this long between later chunks


class CurveServer:
    """A streaming /v1/completions whose TTFT grows with the prompt; records prompts and concurrency."""

    def __init__(self):
        self.prompts: list[str] = []
        self.in_flight = self.max_in_flight = 0

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "curve-model", "object": "model"}]})

    async def completions(self, request: Request):
        body = await request.json()
        words = len(body["prompt"].split())
        self.prompts.append(body["prompt"])

        async def events():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(words * MS_PER_WORD / 1000 if i == 0 else GAP_S)
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' w{i}'}]})}\n\n"
                usage = {"prompt_tokens": words, "completion_tokens": body["max_tokens"]}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def curve_server():
    state = CurveServer()
    app = Starlette(routes=[Route("/v1/models", state.models),
                            Route("/v1/completions", state.completions, methods=["POST"])])
    with serve_asgi(app) as url:
        yield url, state


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_curve_prompts_have_the_exact_length_and_share_no_prefix():
    """On the served model's tokenizer: every prompt is exactly its length, and no two prompts (the
    warm-up included) share even a few leading tokens, so no prefix cache can serve a prefill."""
    tok = load_tokenizer(ensure_default_model())
    spec = CurveSpec(lengths=(1024, 4096, 6144), repeats=3, output_len=32, seed=0)
    warmup, prompts = ttft_curve.curve_prompts(tok, spec)
    assert [(p.length, p.repeat) for p in prompts[:4]] == [(1024, 0), (4096, 0), (6144, 0), (1024, 1)]
    assert len(prompts) == 9 and all(p.request.max_tokens == 32 for p in prompts)
    encoded = [tok.encode(warmup.prompt, add_special_tokens=False)]
    assert len(encoded[0]) == 6144
    for p in prompts:
        encoded.append(tok.encode(p.request.prompt, add_special_tokens=False))
        assert len(encoded[-1]) == p.length
    assert max(_common_prefix(a, b) for i, a in enumerate(encoded) for b in encoded[i + 1:]) < 4
    # Every server gets the same prompts: the same spec builds them again, a new seed builds others.
    assert ttft_curve.curve_prompts(tok, spec)[1] == prompts
    assert ttft_curve.curve_prompts(tok, CurveSpec((1024,), 1, 32, seed=1))[1][0] != prompts[0]


def test_exact_length_text_on_a_tokenizer_with_few_words():
    tok = _tiny_tokenizer()
    words = word_token_ids(tok)
    assert words and all(tok.decode([w]).startswith(" ") for w in words)
    text = exact_length_text(tok, words, 37, seed=5)
    assert len(tok.encode(text, add_special_tokens=False)) == 37
    with pytest.raises(ValueError, match="no plain-word tokens"):
        exact_length_text(tok, [], 5, seed=0)


def test_parse_lengths():
    assert ttft_curve.parse_lengths("1024,4096,6144") == (1024, 4096, 6144)
    assert ttft_curve.parse_lengths("") == () and ttft_curve.parse_lengths(" ") == ()
    with pytest.raises(ValueError):
        ttft_curve.parse_lengths("1024,0")


def test_curve_sends_one_request_at_a_time_and_reports_each_length(curve_server):
    url, state = curve_server
    tok = _tiny_tokenizer()
    spec = CurveSpec(lengths=(20, 200), repeats=2, output_len=3, seed=0)
    warmup, prompts = ttft_curve.curve_prompts(tok, spec)
    out = asyncio.run(ttft_curve.run_curve(url, warmup, prompts, spec))
    assert state.max_in_flight == 1 and len(state.prompts) == 5 and len(set(state.prompts)) == 5
    assert state.prompts[0] == warmup.prompt  # the warm-up first, then the curve
    for length in (20, 200):
        level = out[str(length)]
        assert level["completed"] == 2 and level["failed"] == 0 and level["output_tokens"] == [3, 3]
        assert level["server_prompt_tokens"] == [length]  # what the server counted, not what we asked
        # TTFT from the fake prefill (length x 0.5 ms), TPOT from its gaps (20 ms).
        assert length * MS_PER_WORD * 0.9 <= level["median_ttft_ms"] < length * MS_PER_WORD + 1000
        assert GAP_S * 1000 * 0.9 <= level["median_tpot_ms"] < 500
    assert out["200"]["median_ttft_ms"] > out["20"]["median_ttft_ms"]


def test_curve_ratios_are_tpserve_over_the_peer():
    ours = {"output_len": 32, "1024": {"median_ttft_ms": 50.0, "median_tpot_ms": 10.0},
            "4096": {"median_ttft_ms": None, "median_tpot_ms": None}}
    peer = {"1024": {"median_ttft_ms": 100.0, "median_tpot_ms": 8.0}, "4096": {"median_ttft_ms": 9.0}}
    assert ttft_curve.curve_ratios(ours, peer) == {"1024": {"median_ttft_ms": 0.5, "median_tpot_ms": 1.25},
                                                   "4096": {"median_ttft_ms": None, "median_tpot_ms": None}}


def test_each_server_is_started_for_the_curve_with_room_for_the_longest_prompt(curve_server, monkeypatch):
    """Started once each, llama.cpp with one slot, all with max_model_len >= longest + output; stopped."""
    url, state = curve_server
    starts, stops = [], []

    class Started:
        base_url, log_path = url, Path("/tmp/fake.log")

        def stop(self):
            stops.append(1)

    def starter(name):
        def start(*a):
            args = a[-1]
            starts.append((name, a[1] if name == "llamacpp" else None, args.max_model_len))
            return Started()
        return start

    for name in ("tpserve", "vllm", "llamacpp"):
        monkeypatch.setattr(serve_compare, f"start_{name}", starter(name))
    args = serve_compare.make_parser().parse_args(["--max-model-len", "64"])
    args.tokenizer_dir = None
    spec = CurveSpec(lengths=(20, 100), repeats=1, output_len=3, seed=0)
    out = serve_compare.run_ttft_curves(Path("/m"), _tiny_tokenizer(), spec, args)
    assert starts == [("tpserve", None, 103), ("vllm", None, 103), ("llamacpp", 1, 103)] and len(stops) == 3
    assert args.max_model_len == 64  # the levels' servers keep theirs
    assert out["max_model_len"] == 103 and out["lengths"] == [20, 100]
    assert all(out[name]["100"]["completed"] == 1 for name in ("tpserve", "vllm", "llamacpp"))
    assert set(out["ratios_tpserve_over_vllm"]) == {"20", "100"} and "ratios_tpserve_over_llamacpp" in out


def test_serve_compare_prints_the_curve(curve_server, tmp_path):
    url, _ = curve_server
    _tiny_tokenizer().save_pretrained(tmp_path / "tok")
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = serve_compare.main(["--model-dir", str(tmp_path / "tok"), "--skip", "vllm", "--skip", "llamacpp",
                                 "--tpserve-base-url", url, "--skip-offline", "--concurrencies", "2",
                                 "--prompts-per-stream", "4", "--input-len-min", "5", "--input-len-max", "9",
                                 "--output-len", "2", "--dtype", "float32", "--ttft-curve", "16,48",
                                 "--ttft-curve-repeats", "2", "--ttft-curve-output-len", "3"])
    assert rc == 0
    curve = json.loads(buf.getvalue())["ttft_curve"]
    assert curve["tpserve"]["16"]["completed"] == 2 and curve["tpserve"]["48"]["server_prompt_tokens"] == [48]
