"""The benchmark timing harness (pipeline/bench/common.py) on fake methods and a fake clock: interleaving order,
warm-up, every repeat recorded, median / min / max, ratios of medians with their ranges, and verdicts that say
"within noise" when two methods' ranges overlap and name a winner only when they do not. No real timing is asserted."""

import pytest

from decoding.metrics import mean_over_users
from pipeline.bench import common
from pipeline.bench.common import Timing, compare, interleaved, overlap, ratio, run_order, spread
from pipeline.bench.disc import verdict_disc
from pipeline.bench.speculative import verdict_speculative


@pytest.fixture
def clock(monkeypatch):
    """A fake perf_counter that only moves when a fake method says it took some seconds."""
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    return now


def fake_methods(clock, costs: dict[str, list[float]], calls: list[str]):
    """name -> a method that records its call and advances the clock by its next cost (warm-up first)."""

    def method(name):
        def run():
            calls.append(name)
            clock[0] += costs[name].pop(0)
            return f"{name} output {len(calls)}"

        return run

    return {name: method(name) for name in costs}


def test_interleaved_alternates_and_records_every_repeat(clock):
    calls = []
    costs = {"A": [9.0, 1.0, 2.0, 3.0, 4.0, 5.0], "B": [9.0, 10.0, 20.0, 30.0, 40.0, 50.0]}  # warm-up, 5 repeats
    run = interleaved(fake_methods(clock, costs, calls), repeats=5)
    assert calls == ["A", "B", "A", "B", "B", "A", "A", "B", "B", "A", "A", "B"]  # warm-ups, then A first, B first...
    assert run.order == calls[2:]
    assert run.timings["A"].seconds == [1.0, 2.0, 3.0, 4.0, 5.0]  # the warm-up is not timed
    assert run.timings["B"].seconds == [10.0, 20.0, 30.0, 40.0, 50.0]
    assert run.outputs == {"A": "A output 11", "B": "B output 12"}  # the last repeat's outputs
    assert run.timings["A"].peak_memory_mb is None


def test_interleaved_rotates_many_methods_and_uses_the_warmup_callables(clock):
    calls = []
    methods = fake_methods(clock, {n: [1.0] * 4 for n in "ABC"}, calls)
    warm = {"A": lambda: calls.append("warm A")}
    run = interleaved(methods, repeats=3, warmup=warm)
    assert calls[:3] == ["warm A", "B", "C"]
    assert run.order == ["A", "B", "C", "B", "C", "A", "C", "A", "B"]
    assert run_order(["A", "B", "C"], 4) == [["A", "B", "C"], ["B", "C", "A"], ["C", "A", "B"], ["A", "B", "C"]]
    assert run_order(["A", "B"], 3) == [["A", "B"], ["B", "A"], ["A", "B"]]
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        interleaved(methods, repeats=0)


def test_timing_median_min_max_and_derived_quantities():
    t = Timing([3.0, 1.0, 2.0, 10.0, 4.0])
    assert (t.median, t.min, t.max) == (3.0, 1.0, 10.0)
    assert t.to_dict() == {"seconds": [3.0, 1.0, 2.0, 10.0, 4.0], "median_s": 3.0, "min_s": 1.0, "max_s": 10.0}
    assert t.per(lambda s: 60 / s) == {"median": 20.0, "min": 6.0, "max": 60.0}  # users/s: min and max swap
    assert Timing([1.0, 2.0, 3.0, 4.0]).median == 2.5
    assert spread([5, 1, 3]) == {"median": 3.0, "min": 1.0, "max": 5.0}
    assert Timing([1.0], peak_memory_mb=7.0).to_dict()["peak_memory_mb"] == 7.0


def test_ratio_and_verdict_name_a_winner_only_for_separated_ranges():
    slow, fast = Timing([10.0, 11.0, 12.0, 9.0, 10.0]), Timing([2.0, 2.5, 1.5, 2.0, 2.0])
    r = ratio(slow, fast)  # fast's speed-up over slow
    assert r == {
        "median": 5.0,
        "low": 9.0 / 2.5,
        "high": 12.0 / 1.5,
        "within_noise": False,
        "per_repeat": [5.0, 11.0 / 2.5, 8.0, 4.5, 5.0],
    }
    assert not overlap(slow, fast)
    assert compare("fast", "slow", r) == "fast 5.00x (3.60-8.00) faster than slow"
    assert compare("slow", "fast", ratio(fast, slow)).startswith("fast 5.00x")  # the faster one is named
    a, b = Timing([1.0, 1.1, 5.0, 1.2, 1.0]), Timing([1.3, 1.4, 1.2, 1.5, 1.4])  # a's median wins, ranges overlap
    r = ratio(b, a)
    assert r["median"] == pytest.approx(1.4 / 1.1) and r["within_noise"] and overlap(a, b)
    assert compare("a", "b", r).startswith("a vs b: within noise") and "faster" not in compare("a", "b", r)


def speculative_result(best_ws_range):
    """A speculative result with one batch, K=1: a strict cell at WS 1.1 and a relaxed cell, the best by median."""
    low, high = best_ws_range
    cells = {
        "d|strict": {"ws": 1.1, "ws_range": [1.05, 1.15], "within_noise": False, "same_as_beam_search": 1.0},
        "d|relaxed": {"ws": 4.8, "ws_range": [low, high], "within_noise": low <= 1 <= high},
    }
    return {"speculative": {"batches": [{"batch": 1, "k": {"1": {"drafts": cells}}}]}}


def test_speculative_verdict_picks_the_best_median_and_says_within_noise():
    separated = verdict_speculative(speculative_result((4.0, 5.5)))
    assert "batch 1 4.80x (4.00-5.50) (d relaxed, K=1)" in separated and "within noise" not in separated
    noisy = verdict_speculative(speculative_result((0.2, 9.0)))  # one fast repeat cannot make a winner
    assert "batch 1 4.80x (0.20-9.00) (d relaxed, K=1, within noise of beam_search)" in noisy
    assert "identical to beam_search on 100% of users" in noisy


def test_disc_verdict_from_medians():
    disc = Timing([30.0, 31.0, 29.0])
    result = {
        "args": {"max_rounds": 2},
        "disc": {
            "k": 3,
            "methods": {
                "disc rounds=2 exact": {
                    "ms_per_user": disc.per(lambda s: s),
                    "proposals_per_item": 1.5,
                    "acceptance_rate": 0.7,
                }
            },
            "disc_vs_constrained": ratio(disc, Timing([10.0, 10.0, 10.0])),
            "disc_vs_beam_search": ratio(disc, Timing([28.0, 35.0, 20.0])),
        },
    }
    line = verdict_disc(result)
    assert "3.0x (2.9-3.1) the time of constrained sampling," in line
    assert "1.1x (0.8-1.6) (within noise) that of beam_search" in line


def test_mean_over_users():
    cells = [{"tv": 0.2, "mean_x_se": 0.3}, {"tv": 0.4, "mean_x_se": 0.4}]
    assert mean_over_users(cells) == pytest.approx({"tv": 0.3, "mean_x_se": 0.25})
