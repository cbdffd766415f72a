"""The engine's sampling outputs against HF transformers on the default model (float32):

- logprobs equal the log-softmax of the model's RAW logits (before temperature and penalties, as
  OpenAI and vLLM report them), for sampled, penalized and greedy requests in one batch;
- greedy decoding with a repetition penalty equals HF `generate` with the same penalty.
"""

from __future__ import annotations

import pytest
import torch

from scheduler.sampling_params import SamplingParams
from tests.engine_helpers import PROMPTS, _hf_model, make_engine, run_engine
from tests.model_fixtures import default_model_path

TOLERANCE = 1e-3


def hf_position_logprobs(path: str, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output), V] log-softmax of HF's logits at each position that produced an output token."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = _hf_model(path)(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)


def assert_logprobs_match(positions, output_ids: list[int], reference: torch.Tensor, num_top: int, name: str) -> None:
    assert [p.sampled.token_id for p in positions] == output_ids, name
    for n, position in enumerate(positions):
        ref = reference[n]
        assert abs(position.sampled.logprob - float(ref[output_ids[n]])) < TOLERANCE, (name, n)
        assert len(position.top) == num_top, (name, n)
        # The reported top-N are the N largest (near-ties may swap order between kernels).
        nth_largest = float(ref.topk(num_top).values[-1]) if num_top else 0.0
        for entry in position.top:
            assert abs(entry.logprob - float(ref[entry.token_id])) < TOLERANCE, (name, n, entry)
            assert entry.logprob >= nth_largest - TOLERANCE, (name, n, entry)
        values = [entry.logprob for entry in position.top]
        assert values == sorted(values, reverse=True), (name, n)


@pytest.fixture(scope="module")
def engine():
    engine = make_engine(default_model_path())
    yield engine
    engine.shutdown()


def test_engine_logprobs_equal_hf_raw_log_softmax(engine):
    path = default_model_path()
    max_tokens = 8
    params = {
        "greedy": SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True),
        "sampled_penalized": SamplingParams(max_tokens=max_tokens, temperature=0.6, top_k=30, seed=7,
                                            repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5,
                                            logit_bias={13: 4.0}, logprobs=3, ignore_eos=True),
        "hot": SamplingParams(max_tokens=max_tokens, temperature=1.8, top_p=0.9, seed=8, logprobs=0, ignore_eos=True),
        "no_logprobs": SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=9, ignore_eos=True),
    }
    prompts = {name: engine.tokenizer.encode(PROMPTS[i]) for i, name in enumerate(params)}
    for name in params:
        engine.add_request(name, prompts[name], params[name])
    positions: dict[str, list] = {name: [] for name in params}
    output_ids: dict[str, list[int]] = {name: [] for name in params}
    saw_none = True
    while engine.has_unfinished_requests():
        for out in engine.step():
            output_ids[out.request_id].extend(out.new_token_ids)
            if out.request_id == "no_logprobs":
                saw_none = saw_none and out.new_logprobs is None
            elif out.new_logprobs:
                positions[out.request_id].extend(out.new_logprobs)
    assert saw_none
    for name in ("greedy", "sampled_penalized", "hot"):
        reference = hf_position_logprobs(path, prompts[name], output_ids[name])
        assert len(positions[name]) == len(output_ids[name]) == max_tokens
        assert_logprobs_match(positions[name], output_ids[name], reference, params[name].logprobs, name)
    # The penalties and the temperature did change what was sampled (so "raw" means something):
    # some sampled token is not the raw argmax.
    reference = hf_position_logprobs(path, prompts["sampled_penalized"], output_ids["sampled_penalized"])
    assert (reference.argmax(-1) != torch.tensor(output_ids["sampled_penalized"])).any()


def test_greedy_with_repetition_penalty_equals_hf_generate(engine):
    path = default_model_path()
    prompt_ids = engine.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3)
    ours = run_engine(engine, {"r": (prompt_ids, params)})["r"]
    with torch.no_grad():
        generated = _hf_model(path).generate(
            torch.tensor([prompt_ids]), do_sample=False, repetition_penalty=1.3, max_new_tokens=24,
            pad_token_id=engine.tokenizer.eos_token_id)  # EOS ids: the model's generation config
    assert ours == generated[0, len(prompt_ids):].tolist()
    without = run_engine(engine, {"g": (prompt_ids, SamplingParams(max_tokens=24, temperature=0.0))})["g"]
    assert without != ours, "the penalty must change this output for the test to mean anything"


def test_logit_bias_and_allowed_bitmask_reach_the_sampler_and_a_dead_row_fails_alone(engine, monkeypatch):
    """End to end through scheduler, worker and sampler: logit_bias forces a token; the bitmask
    carried in SchedulerOutput allows exactly one token for one request and none for another,
    which then ends alone with finish_reason "abort" while its batch mates finish normally."""
    vocab = engine.model_config.vocab_size
    words = (vocab + 31) // 32
    only_token = 1234
    only_one = [0] * words
    only_one[only_token // 32] = 1 << (only_token % 32)
    schedule = engine.scheduler.schedule

    def schedule_with_masks():
        out = schedule()
        for request_id in out.num_scheduled_tokens:
            if request_id == "only_one":
                out.allowed_token_bitmasks[request_id] = only_one
            elif request_id == "nothing":
                out.allowed_token_bitmasks[request_id] = [0] * words
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_with_masks)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    params = {
        "biased": SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={13: 100.0}),
        "only_one": SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True),
        "nothing": SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        "free": SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    }
    for name, p in params.items():
        engine.add_request(name, prompt, p)
    tokens = {name: [] for name in params}
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in tokens:
                continue  # left over from an earlier test of this module's engine that failed midway
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert tokens["biased"] == [13] * 4 and tokens["only_one"] == [only_token] * 4
    assert tokens["nothing"] == [] and finished["nothing"] == "abort"
    assert finished["free"] == "length" and tokens["free"] == hf_greedy_ids(prompt, 4)


def hf_greedy_ids(prompt_ids: list[int], num: int) -> list[int]:
    from tests.engine_helpers import hf_greedy

    return hf_greedy(default_model_path(), prompt_ids, num)
