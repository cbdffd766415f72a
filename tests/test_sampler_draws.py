"""What `sample()` draws: the right distribution, inside the reference's support, one request's
failure kept to that request, and every parameter value the HTTP layer lets through computable.

The statistical tests draw many tokens from ONE step (one row per draw, one batch), so they run
in well under a second; seeds are fixed, so each outcome is deterministic.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from scheduler.sampling_params import SamplingParams as SP
from tests.sampling_reference import hf_reference, row
from workers.sampling.sampler import NON_FINITE_LOGITS, NOTHING_ALLOWED, sample

NUM_DRAWS = 20_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against probabilities (bins expecting < 5 merged)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    # Upper tail of chi-square(dof) = Q(dof / 2, x / 2).
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0))


def step_logits(vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2.5


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("params", [
    SP(temperature=1.0),
    SP(temperature=0.7, top_k=12),
    SP(temperature=1.3, top_p=0.8, repetition_penalty=1.4, frequency_penalty=0.3),
    SP(temperature=0.9, min_p=0.05, logit_bias={3: 2.0}),
], ids=["plain", "top_k", "top_p_penalties", "min_p_bias"])
def test_draws_follow_the_filtered_distribution(params, seeded):
    logits = step_logits(64, seed=5)
    reference = hf_reference(logits, params)
    torch.manual_seed(0)  # unseeded rows use the global generator
    rows = [row(params, torch.Generator().manual_seed(i) if seeded else None) for i in range(NUM_DRAWS)]
    out = sample(logits.expand(NUM_DRAWS, -1).contiguous(), rows)
    assert not out.errors
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=64)
    assert (counts[reference == 0] == 0).all(), "a token outside the reference's support was drawn"
    p_value = chi_square_p_value(counts, reference)
    assert p_value > 1e-3, f"draws do not follow the reference distribution (p = {p_value:.2e})"


def test_chi_square_check_rejects_a_wrong_distribution():
    """The statistic above has power: draws from the unfiltered softmax fail against top-k."""
    logits = step_logits(64, seed=5)
    rows = [row(SP(temperature=1.0), torch.Generator().manual_seed(i)) for i in range(NUM_DRAWS)]
    out = sample(logits.expand(NUM_DRAWS, -1).contiguous(), rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=64)
    assert chi_square_p_value(counts, hf_reference(logits, SP(temperature=0.7))) < 1e-6


@pytest.mark.parametrize("params", [SP(temperature=1.0, top_k=50), SP(temperature=1.5, top_p=0.6),
                                    SP(temperature=1.0, top_k=200, top_p=0.9, min_p=0.02)])
def test_every_draw_lies_in_the_reference_support_on_a_full_vocabulary(params):
    vocab, draws = 49152, 100
    logits = step_logits(vocab, seed=6)
    support = hf_reference(logits, params) > 0
    rows = [row(params, torch.Generator().manual_seed(i)) for i in range(draws)]
    out = sample(logits.expand(draws, -1).contiguous(), rows)
    assert support[torch.tensor(out.token_ids)].all()
    assert len(set(out.token_ids)) > 1  # really sampling, not a disguised argmax


def test_seeded_rows_do_not_depend_on_batch_mates_or_position():
    logits = torch.randn(5, 500, generator=torch.Generator().manual_seed(7))
    seeded = SP(temperature=1.0, top_p=0.95, seed=1)

    def draw(position: int, mates: list[SP]) -> int:
        params = mates[:position] + [seeded] + mates[position:]
        rows = [row(p, torch.Generator().manual_seed(42) if p is seeded else None) for p in params]
        batch = torch.cat([logits[1:][:position], logits[:1], logits[1:][position:len(mates)]])
        return sample(batch, rows).token_ids[position]

    mates = [SP(temperature=0.0), SP(temperature=1.0), SP(temperature=0.5, top_k=3), SP(temperature=2.0)]
    assert len({draw(0, []), draw(0, mates), draw(2, mates), draw(4, mates)}) == 1


def test_greedy_rows_take_the_argmax_of_the_penalized_logits():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(8))
    params = [SP(temperature=0.0), SP(temperature=0.0, repetition_penalty=1.8), SP(temperature=0.0, logit_bias={9: 50})]
    out = sample(logits, [row(p) for p in params])
    expected = [int(hf_reference(logits[i], SP(temperature=1.0, repetition_penalty=p.repetition_penalty,
                                               logit_bias=dict(p.logit_bias))).argmax()) for i, p in enumerate(params)]
    assert out.token_ids == expected and out.token_ids[2] == 9


def test_bf16_logits_give_the_tokens_and_logprobs_of_their_float32_copy(monkeypatch):
    """The runner hands over the model's bf16 logits: a batch of plain greedy rows is answered
    from them as they are (no float32 copy), any row that reads more (sampling, a processor,
    logprobs) takes the batch to float32 first; either way the tokens, errors and logprobs are
    those of the float32 logits."""
    logits = (torch.randn(4, 500, generator=torch.Generator().manual_seed(13)) * 3).bfloat16()
    logits[3, 5] = float("nan")
    seen = []
    monkeypatch.setattr("workers.sampling.sampler.torch_row_max", lambda x: seen.append(x.dtype) or x.max(dim=-1))
    from workers.sampling import sampler
    for params, dtype in ((SP(temperature=0.0), torch.bfloat16), (SP(temperature=0.0, logprobs=2), torch.float32),
                          (SP(temperature=0.0, repetition_penalty=1.3), torch.float32),
                          (SP(temperature=0.8, seed=5), torch.float32)):
        rows = lambda: [row(params, torch.Generator().manual_seed(i)) for i in range(4)]  # noqa: E731
        seen.clear()
        out = sampler.sample(logits, rows(), sampler.torch_row_max)
        ref = sampler.sample(logits.float(), rows(), sampler.torch_row_max)
        assert seen[0] == dtype, params
        assert out.token_ids == ref.token_ids and out.errors == ref.errors == {3: NON_FINITE_LOGITS}
        assert out.logprobs == ref.logprobs


def test_logprobs_are_the_raw_log_softmax_whatever_the_filters():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(9)) * 3
    params = [SP(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=4),
              SP(temperature=0.0, logprobs=0), SP(temperature=1.0)]
    out = sample(logits, [row(p, torch.Generator().manual_seed(1)) for p in params])
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i in (0, 1):
        token, value = out.logprobs[i].sampled
        assert token == out.token_ids[i] and value == pytest.approx(float(raw[i, token]), abs=1e-5)
    top_values, top_ids = raw[0].topk(4)
    assert [t for t, _ in out.logprobs[0].top] == top_ids.tolist()
    assert [v for _, v in out.logprobs[0].top] == pytest.approx(top_values.tolist(), abs=1e-5)
    assert out.logprobs[1].top == [] and out.logprobs[2] is None


# ---- one request's failure stays with that request (issue 12) ----------------------------------

MATES = [SP(temperature=0.0, logprobs=2), SP(temperature=0.8, top_k=20, seed=3), SP(temperature=1.0, top_p=0.9, seed=4)]


def _mates_alone(logits: torch.Tensor) -> list[int | None]:
    rows = [row(p, torch.Generator().manual_seed(i)) for i, p in enumerate(MATES)]
    return sample(logits, rows).token_ids


def test_a_non_finite_row_fails_alone():
    logits = torch.randn(4, 400, generator=torch.Generator().manual_seed(10))
    expected = _mates_alone(logits[:3].clone())
    bad = logits.clone()
    bad[3, 17] = float("nan")
    rows = [row(p, torch.Generator().manual_seed(i)) for i, p in enumerate(MATES)] + [row(SP(temperature=0.0))]
    out = sample(bad, rows)
    assert out.errors == {3: NON_FINITE_LOGITS} and out.token_ids == expected + [None]


def test_an_exception_for_one_row_fails_only_that_row():
    logits = torch.randn(4, 400, generator=torch.Generator().manual_seed(11))
    expected = _mates_alone(logits[:3].clone())
    rows = [row(p, torch.Generator().manual_seed(i)) for i, p in enumerate(MATES)]
    # A corrupt token list makes the repetition penalty raise while the batch is built.
    rows.append(row(SP(temperature=0.0, repetition_penalty=1.2)))
    rows[-1].prompt_token_ids = [1, "not a token id"]
    out = sample(logits, rows)
    assert out.token_ids == expected + [None]
    assert list(out.errors) == [3] and "TypeError" in out.errors[3]


def test_a_row_with_every_token_excluded_fails_alone():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(12))
    rows = [row(SP(temperature=0.0), allowed_token_bitmask=[0, 0]),  # nothing allowed
            row(SP(temperature=1.0, seed=1), torch.Generator().manual_seed(1), allowed_token_bitmask=[0, 0]),
            row(SP(temperature=0.0), allowed_token_bitmask=[0, 1 << 4])]  # only token 36
    out = sample(logits, rows)
    assert out.errors == {0: NOTHING_ALLOWED, 1: NOTHING_ALLOWED} and out.token_ids[2] == 36


# The bounds the HTTP layer enforces (deployments/http/protocol.py) and a little beyond: every
# combination must give a token, never an error or an exception.
EXTREMES = {
    "temperature": [0.0, 1e-5, 2e-5, 2.0, 100.0],
    "top_p": [1e-9, 0.5, 1.0],
    "top_k": [-1, 0, 1, 10**30],
    "min_p": [0.0, 1.0],
    "repetition_penalty": [1e-50, 1e-3, 1.0, 2.0, 1e6],
    "frequency_penalty": [-2.0, 2.0],
    "presence_penalty": [-2.0, 2.0],
}


def test_every_extreme_parameter_combination_samples_a_token():
    names = list(EXTREMES)
    combos = [dict(zip(names, values)) for values in itertools.product(*EXTREMES.values())]
    params = [SP(**c, logprobs=20, min_tokens=100, stop_token_ids=(10**9, -1),
                 logit_bias={0: 100.0, 1: -100.0, 10**9: 5.0}) for c in combos]
    logits = torch.randn(len(params), 2048, generator=torch.Generator().manual_seed(13)) * 30
    rows = [row(p, torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
    out = sample(logits, rows)
    failed = {i: combos[i] for i in out.errors}
    assert not failed, f"{len(failed)} combinations failed, e.g. {next(iter(failed.values()))}"
    assert all(0 <= t < 2048 for t in out.token_ids)
    assert all(all(v == v and v <= 0 for _, v in lp.top) for lp in out.logprobs)
