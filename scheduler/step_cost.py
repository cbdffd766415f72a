"""A step's forward time predicted from the work in it, learned online from the steps that ran.

The scheduler uses it to keep decodes from waiting behind prefill: a step that carries decodes
gets only the prefill tokens that fit a time target (Scheduler._prefill_time_left). A token budget
cannot do that across machines: the same 2,048-token chunk is a few milliseconds on a GPU and
half a second on a 2-core CPU, and on one machine its cost grows with the context it attends to.

The model is linear in five features:

    seconds ~ a + b * decode rows + c * decode context tokens
                + d * prefill tokens + e * prefill attention pairs

Decode rows pay the weight reads and per-row work; their contexts the K/V reads of decode
attention; prefill tokens the projections; attention pairs (query x key, causal) what makes a
long prompt's later chunks dearer than its first. Every coefficient is a cost, so the fit is
non-negative least squares.

The fit keeps exponentially weighted normal equations (X'X and X'y), one pair for decode-only
steps and one for steps with prefill. Every step ages both by 0.98 (the machine's speed drifts,
and the last ~50 steps say more than the first), except that a kind which did not run this step
stops ageing once its weight is down to ~20 steps' worth: a closed loop runs hundreds of
decode-only steps between prefill waves, and the prefill costs must outlive them. An earlier
version ran recursive least squares with one forgetting factor. Through those decode-only runs
the prefill directions got no data while their covariance grew by 1/0.98 a step; it lost positive
definiteness (negative variances after a few thousand steps), the coefficients went to nonsense
(a negative cost per context token) and the scheduler alternated 32-token slivers with 500-token
stalls: p99 inter-token latency back at ~300 ms in one round, a quarter less throughput in another
(16 closed-loop streams on a 2-core EPYC, 2026-12-06). Normal equations only add positive
semidefinite terms, and a kind of step that stops arriving keeps what its last steps said.
"""

from __future__ import annotations

from dataclasses import dataclass

# Feature scales: each feature is divided by its scale so that all are O(1-100) at the sizes a
# step has (the fit's conditioning).
_SCALES = (1.0, 16.0, 16_384.0, 256.0, 1_048_576.0)
# Weight of a step t steps old: 0.98^t (the last ~50 steps carry most of the fit).
_FORGETTING = 0.98
# A kind of step that did not run stops ageing at this much weight (in steps' worth).
_MIN_KIND_WEIGHT = 20.0
# Steps with prefill and steps with decodes it must have seen before it predicts.
_MIN_PREFILL_STEPS = 4
_MIN_DECODE_STEPS = 4
# Added to the diagonal of a solve, relative to its largest entry: features that moved together
# in every step seen (prefill tokens and attention pairs of same-length chunks) leave the normal
# equations singular, and the small ridge picks the least-norm split between them.
_RIDGE = 1e-9


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

    def raw_features(self) -> tuple[float, ...]:
        """The five features (a constant 1 first) in their own units."""
        return (1.0, self.decode_rows, self.decode_context_tokens, self.prefill_tokens, self.prefill_attention_pairs)

    def features(self) -> tuple[float, ...]:
        """The same, scaled to similar magnitudes (the fit's conditioning)."""
        return tuple(value / scale for value, scale in zip(self.raw_features(), _SCALES))


def chunk_attention_pairs(start: int, num_tokens: int) -> int:
    """Causal query x key pairs of a chunk of num_tokens queries after `start` cached tokens."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepCostModel:
    """Non-negative least squares over StepWork features (see the module doc)."""

    def __init__(self) -> None:
        n = len(_SCALES)
        # Exponentially weighted X'X and X'y of decode-only steps [False] and steps with prefill [True].
        self._gram = {kind: [[0.0] * n for _ in range(n)] for kind in (False, True)}
        self._moment = {kind: [0.0] * n for kind in (False, True)}
        self._weight = {kind: 0.0 for kind in (False, True)}  # sum of each kind's step weights
        self._coef = (0.0,) * n  # the fit: seconds per unit of each raw feature
        self._stale = False  # observations arrived since the fit was solved
        self._prefill_steps = 0
        self._decode_steps = 0

    @property
    def ready(self) -> bool:
        return self._prefill_steps >= _MIN_PREFILL_STEPS and self._decode_steps >= _MIN_DECODE_STEPS

    @property
    def coefficients(self) -> tuple[float, ...]:
        """Seconds per unit of each feature (a, b, c, d, e of the module doc), all >= 0."""
        self._solve()
        return self._coef

    def observe(self, work: StepWork, seconds: float) -> None:
        """Fold one step's measured forward time into the fit (solved when next needed)."""
        if seconds <= 0 or (work.decode_rows == 0 and work.prefill_tokens == 0):
            return
        self._prefill_steps += work.prefill_tokens > 0
        self._decode_steps += work.decode_rows > 0
        kind = work.prefill_tokens > 0
        for aged in (False, True):
            if aged == kind or self._weight[aged] > _MIN_KIND_WEIGHT:
                self._age(aged)
        gram, moment, x = self._gram[kind], self._moment[kind], work.features()
        for i, xi in enumerate(x):
            moment[i] += xi * seconds
            row = gram[i]
            for j, xj in enumerate(x):
                row[j] += xi * xj
        self._weight[kind] += 1.0
        self._stale = True

    def _age(self, kind: bool) -> None:
        self._weight[kind] *= _FORGETTING
        self._moment[kind] = [_FORGETTING * value for value in self._moment[kind]]
        self._gram[kind] = [[_FORGETTING * value for value in row] for row in self._gram[kind]]

    def _solve(self) -> None:
        if not self._stale:
            return
        n = len(_SCALES)
        gram = [[self._gram[False][i][j] + self._gram[True][i][j] for j in range(n)] for i in range(n)]
        moment = [self._moment[False][i] + self._moment[True][i] for i in range(n)]
        self._coef = tuple(c / scale for c, scale in zip(nonnegative_least_squares(gram, moment), _SCALES))
        self._stale = False

    def prefill_seconds(self, start: int, num_tokens: int) -> float:
        """What a chunk of num_tokens after `start` cached tokens adds to a step."""
        coef = self.coefficients
        return coef[3] * num_tokens + coef[4] * chunk_attention_pairs(start, num_tokens)

    def predict(self, work: StepWork) -> float:
        """Seconds the fit expects a step of `work` to take (meaningful once `ready`)."""
        return sum(c * v for c, v in zip(self.coefficients, work.raw_features()))

    def prefill_tokens_within(self, seconds: float, start: int, limit: int) -> int:
        """The most tokens (<= limit) of a chunk after `start` cached tokens whose added cost fits
        in `seconds`; 0 when none fits. `limit` when the fit's marginal prefill cost is not
        positive (prefill not yet separable from the rest of a step: the token budget rules)."""
        if seconds <= 0 or limit <= 0:
            return 0
        coef = self.coefficients
        if coef[3] + coef[4] * start <= 0:
            return limit
        lo, hi = 0, limit  # the added cost grows with n: bisect for the largest n that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.prefill_seconds(start, mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo


def nonnegative_least_squares(gram: list[list[float]], moment: list[float]) -> list[float]:
    """argmin over c >= 0 of c'Gc - 2 m'c (least squares from its normal equations G = X'X,
    m = X'y), by Lawson and Hanson's active-set method: grow the set of free coefficients by the
    one whose gradient most wants to rise, solve on the free set, and where that solution has a
    negative entry step back to where the first one reaches zero and drop it."""
    n = len(moment)
    coef = [0.0] * n
    free = [False] * n
    scale = max((abs(gram[i][i]) for i in range(n)), default=0.0)
    if scale <= 0:
        return coef
    tolerance = 1e-12 * scale * max(1.0, max(abs(m) for m in moment))
    for _ in range(3 * n):  # Lawson-Hanson ends in a few rounds; the bound only guards the loop
        gradient = [moment[i] - sum(gram[i][j] * coef[j] for j in range(n)) for i in range(n)]
        rising = [i for i in range(n) if not free[i] and gradient[i] > tolerance]
        if not rising:
            break
        free[max(rising, key=gradient.__getitem__)] = True
        while True:
            index = [i for i in range(n) if free[i]]
            sub = _solve_with_ridge([[gram[i][j] for j in index] for i in index], [moment[i] for i in index],
                                   _RIDGE * scale)
            if all(value > 0 for value in sub):
                coef = [0.0] * n
                for i, value in zip(index, sub):
                    coef[i] = value
                break
            step = min((coef[i] / (coef[i] - value) for i, value in zip(index, sub)
                        if value <= 0 and coef[i] > value), default=0.0)
            for i, value in zip(index, sub):
                coef[i] += step * (value - coef[i])
                if coef[i] <= 1e-15 * (1.0 + abs(value)):
                    coef[i], free[i] = 0.0, False
            if not any(free):
                break
    return coef


def _solve_with_ridge(matrix: list[list[float]], rhs: list[float], ridge: float) -> list[float]:
    """(matrix + ridge I) x = rhs by Gaussian elimination with partial pivoting (a few unknowns)."""
    n = len(rhs)
    rows = [[*(matrix[i][j] + (ridge if i == j else 0.0) for j in range(n)), rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        if rows[col][col] == 0.0:
            continue
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            if factor:
                for c in range(col, n + 1):
                    rows[r][c] -= factor * rows[col][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        if rows[i][i] != 0.0:
            x[i] = (rows[i][n] - sum(rows[i][j] * x[j] for j in range(i + 1, n))) / rows[i][i]
    return x
