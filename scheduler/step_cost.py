"""A step's forward time predicted from the work in it, learned online from the steps that ran.

The scheduler uses it to keep decodes from waiting behind prefill: a step that carries decodes
gets only the prefill tokens that fit a time target (Scheduler._prefill_time_left). A token budget
cannot do that across machines: the same 2,048-token chunk is a few milliseconds on a GPU and
half a second on a 2-core CPU, and on one machine its cost grows with the context it attends to.

The model is linear in five features, fitted by recursive least squares with forgetting (the
machine's speed drifts, and the last few hundred steps say more than the first):

    seconds ~ a + b * decode rows + c * decode context tokens
                + d * prefill tokens + e * prefill attention pairs

Decode rows pay the weight reads and per-row work; their contexts the K/V reads of decode
attention; prefill tokens the projections; attention pairs (query x key, causal) what makes a
long prompt's later chunks dearer than its first.
"""

from __future__ import annotations

from dataclasses import dataclass

# Feature scales: each feature is divided by its scale so that all are O(1-100) at the sizes a
# step has (the fit's conditioning).
_SCALES = (1.0, 16.0, 16_384.0, 256.0, 1_048_576.0)
# Weight of a step t steps old: 0.98^t (the last ~50 steps carry most of the fit).
_FORGETTING = 0.98
# The prior's variance on each coefficient (large: the first steps move the fit freely).
_PRIOR_VARIANCE = 1e3
# Steps with prefill and steps with decodes it must have seen before it predicts.
_MIN_PREFILL_STEPS = 4
_MIN_DECODE_STEPS = 4


@dataclass
class StepWork:
    """The work of one step in the quantities its time grows with (scheduler -> cost model; the
    scheduler also tallies the step it builds in one)."""

    # Requests computing one new token each.
    decode_rows: int = 0
    # K/V rows those decodes attend to (the sum of their context lengths).
    decode_context_tokens: int = 0
    # Prompt (or recomputed) tokens of the step's prefill chunks.
    prefill_tokens: int = 0
    # Query x key pairs of the prefill chunks' causal attention.
    prefill_attention_pairs: int = 0

    def features(self) -> tuple[float, ...]:
        raw = (1.0, self.decode_rows, self.decode_context_tokens, self.prefill_tokens, self.prefill_attention_pairs)
        return tuple(value / scale for value, scale in zip(raw, _SCALES))


def chunk_attention_pairs(start: int, num_tokens: int) -> int:
    """Causal query x key pairs of a chunk of num_tokens queries after `start` cached tokens."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepCostModel:
    """Recursive least squares over StepWork features (see the module doc)."""

    def __init__(self) -> None:
        n = len(_SCALES)
        self._coef = [0.0] * n
        self._cov = [[_PRIOR_VARIANCE if i == j else 0.0 for j in range(n)] for i in range(n)]
        self._prefill_steps = 0
        self._decode_steps = 0

    @property
    def ready(self) -> bool:
        return self._prefill_steps >= _MIN_PREFILL_STEPS and self._decode_steps >= _MIN_DECODE_STEPS

    def observe(self, work: StepWork, seconds: float) -> None:
        """Fold one step's measured forward time into the fit."""
        if seconds <= 0 or (work.decode_rows == 0 and work.prefill_tokens == 0):
            return
        self._prefill_steps += work.prefill_tokens > 0
        self._decode_steps += work.decode_rows > 0
        x = work.features()
        px = [sum(row[j] * x[j] for j in range(len(x))) for row in self._cov]
        gain_denominator = _FORGETTING + sum(x[i] * px[i] for i in range(len(x)))
        gain = [value / gain_denominator for value in px]
        error = seconds - sum(c * v for c, v in zip(self._coef, x))
        self._coef = [c + g * error for c, g in zip(self._coef, gain)]
        self._cov = [[(self._cov[i][j] - gain[i] * px[j]) / _FORGETTING for j in range(len(x))]
                     for i in range(len(x))]

    def prefill_seconds(self, start: int, num_tokens: int) -> float:
        """What a chunk of num_tokens after `start` cached tokens adds to a step."""
        per_pair = max(0.0, self._coef[4] / _SCALES[4])
        return max(0.0, self._coef[3] / _SCALES[3] * num_tokens + per_pair * chunk_attention_pairs(start, num_tokens))

    def predict(self, work: StepWork) -> float:
        """Seconds the fit expects a step of `work` to take (meaningful once `ready`)."""
        return max(0.0, sum(c * v for c, v in zip(self._coef, work.features())))

    def prefill_tokens_within(self, seconds: float, start: int, limit: int) -> int:
        """The most tokens (<= limit) of a chunk after `start` cached tokens whose added cost fits
        in `seconds`; 0 when none fits. `limit` when the fit's marginal prefill cost is not
        positive (prefill not yet separable from the rest of a step: the token budget rules)."""
        if seconds <= 0 or limit <= 0:
            return 0
        if self._coef[3] / _SCALES[3] + max(0.0, self._coef[4] / _SCALES[4]) * start <= 0:
            return limit
        lo, hi = 0, limit  # the added cost grows with n: bisect for the largest n that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.prefill_seconds(start, mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo
