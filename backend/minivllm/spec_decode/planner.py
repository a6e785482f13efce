"""How many drafts pay this step: a goodput planner over measured step costs.

Verifying k drafts adds k rows to the step. On a GPU extra rows are nearly free; on a CPU they
are not (measured on a 2-core AVX2 box: a 5-row decode step costs ~2.7x a 1-row step in fp32 and
in int4), and a draft model's rounds cost time too. So each step the planner gives drafts only
where they are expected to raise tokens per second: a sequence's j-th draft is emitted with
probability a^j (a: its acceptance rate so far), and costs one more row of the step, plus one
more draft round when it is the deepest. Drafts are added one at a time, best first, while
(expected tokens) / (expected time) still grows.

Costs are measured online, never assumed: forward seconds of decode-only steps by row count
(an exponential moving average per count) and a draft model's seconds for its first round (which
also catches its cache up with what the target accepted: a multi-token chunk) and for each later
round (one token a sequence). Pricing every round like the first overpriced deep drafts by ~50%. Until a row count has
been seen it is priced like the nearest smaller one that has, so a new setup starts out
speculating and learns what that costs on this machine.
"""

from __future__ import annotations

import bisect

EMA = 0.3  # weight of a new observation
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.6, 2.0  # a new sequence is assumed to accept 60%, worth 2 drafts
DECAY = 0.9  # per verify: older drafts count less (a reply changes from quoting to free text)


class StepCosts:
    """Forward seconds by number of decode rows, and a draft model's seconds per round."""

    def __init__(self) -> None:
        self.by_rows: dict[int, float] = {}
        self._known: list[int] = []
        self.first_round_s = 0.0
        self.round_s = 0.0  # a later round; 0 until one is seen

    def observe(self, rows: int, seconds: float) -> None:
        if rows not in self.by_rows:
            bisect.insort(self._known, rows)
            self.by_rows[rows] = seconds
        else:
            self.by_rows[rows] += EMA * (seconds - self.by_rows[rows])

    def observe_rounds(self, seconds: list[float]) -> None:
        """One proposal's rounds, in order: the first, then the later ones."""
        if seconds:
            self.first_round_s = _ema(self.first_round_s, seconds[0])
        for later in seconds[1:]:
            self.round_s = _ema(self.round_s, later)

    def drafting_s(self, rounds: int) -> float:
        if not rounds:
            return 0.0
        return self.first_round_s + (rounds - 1) * (self.round_s or self.first_round_s)

    def step_s(self, rows: int) -> float:
        """Interpolated between measured row counts; an unmeasured larger count costs what the
        largest measured one below it does (optimistic: it gets tried, then measured). Never more
        than a larger count measured: more rows are never cheaper, so a dearer smaller count is an
        outlier (one slow 2-row step, never re-measured once it stopped all drafting, did that)."""
        known = self._known
        if not known:
            return 1.0
        i = bisect.bisect_left(known, rows)
        cap = min(self.by_rows[k] for k in known[i:]) if i < len(known) else float("inf")
        if i < len(known) and known[i] == rows:
            return min(self.by_rows[rows], cap)
        if i == 0:
            return self.by_rows[known[0]]
        if i == len(known):
            return self.by_rows[known[-1]]
        lo, hi = known[i - 1], known[i]
        w = (rows - lo) / (hi - lo)
        return min(self.by_rows[lo] * (1 - w) + self.by_rows[hi] * w, cap)


def _ema(average: float, seconds: float) -> float:
    return seconds if not average else average + EMA * (seconds - average)


class Acceptance:
    """Per sequence: drafts accepted and rejections, decayed (a geometric model's estimate:
    a = accepted / (accepted + rejections))."""

    def __init__(self) -> None:
        self._counts: dict[int, tuple[float, float]] = {}

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        acc, rej = self._counts.get(seq_id, (PRIOR_ACCEPTANCE * PRIOR_WEIGHT, (1 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT))
        self._counts[seq_id] = (acc * DECAY + accepted, rej * DECAY + (1 if accepted < proposed else 0))

    def relax(self, seq_id: int) -> None:
        """A step without drafts: the estimate drifts back towards the prior, so a sequence whose
        drafts once failed is tried again later (its text may have turned to quoting)."""
        acc, rej = self._counts.get(seq_id, (PRIOR_ACCEPTANCE, 1 - PRIOR_ACCEPTANCE))
        prior = (1 - DECAY) * PRIOR_WEIGHT
        self._counts[seq_id] = (acc * DECAY + PRIOR_ACCEPTANCE * prior, rej * DECAY + (1 - PRIOR_ACCEPTANCE) * prior)

    def rate(self, seq_id: int) -> float:
        acc, rej = self._counts.get(seq_id, (PRIOR_ACCEPTANCE, 1 - PRIOR_ACCEPTANCE))
        return acc / (acc + rej) if acc + rej else PRIOR_ACCEPTANCE

    def forget_except(self, live: set[int]) -> None:
        for seq_id in [s for s in self._counts if s not in live]:
            del self._counts[seq_id]


def plan_drafts(rates: list[float], limits: list[int], base_rows: int, costs: StepCosts, per_round: bool) -> list[int]:
    """Drafts per sequence (at most `limits[i]`) that maximise expected tokens per second of the
    next step. `base_rows`: decode rows the step has without drafts; `per_round`: drafting costs
    `costs.drafting_s` for its rounds (a model drafts; n-gram lookup is free)."""
    ks = [0] * len(rates)
    tokens, rows, rounds = float(base_rows), base_rows, 0
    seconds = costs.step_s(rows)
    while True:
        best, best_gain = -1, 0.0
        for i, (a, k) in enumerate(zip(rates, ks)):
            if k < limits[i] and a ** (k + 1) > best_gain:
                best, best_gain = i, a ** (k + 1)
        if best < 0:
            return ks
        extra_round = per_round and ks[best] + 1 > rounds
        new_seconds = costs.step_s(rows + 1) + (costs.drafting_s(rounds + extra_round) if per_round else 0.0)
        if (tokens + best_gain) / new_seconds <= tokens / seconds:
            return ks
        ks[best] += 1
        tokens, rows, seconds, rounds = tokens + best_gain, rows + 1, new_seconds, rounds + extra_round
