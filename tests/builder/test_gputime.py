"""The timing loop's logic (order per round, calls per round, medians, failures) with a fake clock."""

from __future__ import annotations

import pytest

from builder.gputime import round_order, summarize, time_rounds


class FakeClock:
    """Each contender's calls take a fixed time plus a slowdown that grows with every timed call
    (a GPU warming up); records the order in which contenders ran their timed calls."""

    def __init__(self, cost: dict[str, float], drift: float = 0.0) -> None:
        self.cost, self.drift, self.elapsed = cost, drift, 0
        self.timed: list[tuple[str, int]] = []

    def calls(self, fn, n: int, flush: bool) -> list[float]:
        name = fn()
        self.timed.append((name, n))
        out = []
        for _ in range(n):
            self.elapsed += 1
            out.append(self.cost[name] * (1 + self.drift * self.elapsed))
        return out

    def sync(self) -> None:
        pass


def _contenders(names: list[str]) -> dict:
    return {n: (lambda n=n: n) for n in names}


def test_a_shuffled_order_changes_between_rounds_and_repeats_with_the_seed() -> None:
    names = [f"c{i}" for i in range(6)]
    orders = [round_order(names, r, seed=3) for r in range(6)]
    assert len({tuple(o) for o in orders}) > 1 and all(sorted(o) == names for o in orders)
    assert orders == [round_order(names, r, seed=3) for r in range(6)]
    assert [round_order(names, r, seed=4) for r in range(6)] != orders


def test_alternating_order_reverses_every_other_round() -> None:
    assert round_order(["a", "b", "c"], 0, order="alternate") == ["a", "b", "c"]
    assert round_order(["a", "b", "c"], 1, order="alternate") == ["c", "b", "a"]
    with pytest.raises(ValueError, match=r"order must be one of shuffle, alternate, got 'sorted'"):
        round_order(["a"], 0, order="sorted")


def test_every_contender_runs_each_round_in_that_rounds_order() -> None:
    clock = FakeClock({"a": 1.0, "b": 2.0, "c": 4.0})
    time_rounds(_contenders(["a", "b", "c"]), rounds=4, seed=7, clock=clock, budget_ms=10)
    # Per contender: warmup and one calibration call, then per round one untimed call and its timed calls.
    assert [n for _, n in clock.timed[:6]] == [2, 1] * 3
    timed = [name for name, _ in clock.timed[6:][1::2]]
    rounds = [timed[i:i + 3] for i in range(0, 12, 3)]
    assert rounds == [round_order(["a", "b", "c"], r, seed=7) for r in range(4)]


def test_calls_per_round_follow_the_budget_within_bounds() -> None:
    clock = FakeClock({"fast": 0.01, "slow": 100.0})
    time_rounds(_contenders(["fast", "slow"]), rounds=1, clock=clock, budget_ms=25, min_calls=3, max_calls=50)
    counts = {name: n for name, n in clock.timed[-4:] if n != 1}
    assert counts == {"fast": 50, "slow": 3}


def test_medians_and_spread_come_from_the_rounds() -> None:
    clock = FakeClock({"a": 1.0, "b": 3.0}, drift=0.001)
    stats = time_rounds(_contenders(["a", "b"]), rounds=5, clock=clock)
    assert set(stats) == {"a", "b"}
    for name, base in (("a", 1.0), ("b", 3.0)):
        s = stats[name]
        assert len(s.rounds) == 5 and s.low <= s.median <= s.high
        assert s.low > base and s.high < base * 1.5  # the drift is seen, bounded
    assert summarize([3.0, 1.0, 2.0]).median == 2.0 and summarize([1.0, 2.0]).median == 1.5


def test_a_contender_that_fails_is_reported_and_left_out() -> None:
    def broken():
        raise RuntimeError("out of resources: shared memory")

    logged: list[str] = []
    stats = time_rounds({"ok": lambda: "ok", "broken": broken}, rounds=2, clock=FakeClock({"ok": 1.0}),
                        log=logged.append)
    assert set(stats) == {"ok"}
    assert logged == ["broken: RuntimeError: out of resources: shared memory"]
    with pytest.raises(ValueError, match=r"rounds must be >= 1, got 0"):
        time_rounds({"ok": lambda: "ok"}, rounds=0, clock=FakeClock({"ok": 1.0}))
