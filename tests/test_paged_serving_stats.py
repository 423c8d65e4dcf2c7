"""The serving benchmark's readings of the engine's iteration histogram (bucket counts
between two scrapes, bucket quantiles) against the observed values themselves, through the
real ``Metrics`` registry's exposition text; its split of a stream's slow gaps; and its
rate over a run's middle half."""
import bisect
import math
import random
import sys
from pathlib import Path

from prometheus_client import generate_latest

from woq.service.metrics import ITERATION_BUCKETS, Metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from paged_serving import bucket_quantile, iteration_buckets, middle_half_rate, slow_gaps, steps_by_size  # noqa: E402


def _bucket_of(seconds: float) -> str:
    """The label of the histogram bucket that holds ``seconds`` (le bounds are inclusive)."""
    i = bisect.bisect_left(ITERATION_BUCKETS, seconds)
    return "more" if i == len(ITERATION_BUCKETS) else f"<={ITERATION_BUCKETS[i] * 1e3:g}"


def test_iteration_buckets_between_two_scrapes_count_the_values_observed_between():
    rng = random.Random(5)
    metrics = Metrics()
    scrape = lambda: iteration_buckets(generate_latest(metrics.registry).decode())  # noqa: E731
    for _ in range(300):  # before the first scrape: must not be counted
        metrics.on_iteration("decode", rng.uniform(0.001, 0.02))
    before = scrape()
    values = {"decode": [rng.lognormvariate(math.log(0.003), 0.8) for _ in range(1000)],
              "mixed": [rng.uniform(0.01, 3.0) for _ in range(200)]}
    for kind, xs in values.items():
        for x in xs:
            metrics.on_iteration(kind, x)
    after = scrape()
    assert set(after) == {"decode", "mixed"} and set(before) == {"decode"}
    for kind, xs in values.items():
        by_ms = steps_by_size(before.get(kind, {}), after[kind], scale=1e3)
        expected = {label: 0 for label in by_ms}
        for x in xs:
            expected[_bucket_of(x)] += 1
        assert by_ms == expected
        ordered = sorted(xs)
        for q in (0.5, 0.9, 0.99):
            assert bucket_quantile(by_ms, q) == _bucket_of(ordered[math.ceil(q * len(xs)) - 1]), (kind, q)
    assert bucket_quantile({}, 0.5) == "-"


def test_slow_gaps_are_split_by_their_place_in_the_stream():
    ms = 1e-3
    ok = [{"itl": [9 * ms, 2 * ms, 2 * ms, 8 * ms]},   # first and last slow
          {"itl": [2 * ms, 7 * ms, 2 * ms]},           # one between
          {"itl": [6 * ms]},                           # a one-gap stream: its first, not also its last
          {"itl": []}]
    s = slow_gaps(ok, 4 * ms)
    assert (s["count"], s["gaps"], s["first"], s["last"]) == (4, 8, 2, 1)
    assert math.isclose(s["mean_ms"], (9 + 8 + 7 + 6) / 4) and math.isclose(s["threshold_ms"], 4)
    assert s["at"] == [(0, 9.0), (3, 8.0), (1, 7.0), (0, 6.0)]  # (index in its stream, ms), in stream order
    assert slow_gaps(ok, 1.0)["count"] == 0 and slow_gaps(ok, 1.0)["mean_ms"] == 0.0


def test_middle_half_rate_leaves_out_the_ramp_and_the_tail():
    """A run of three parts, each request's tokens at one stamp a token: a ramp (0-10 s, one
    request of 50 tokens), a steady middle (10-30 s: 4 streams at 100 tokens/s each) and a
    tail (30-40 s, one request). The middle half is 10-30 s: 400 tokens/s exactly, where the
    whole run's mean is (50 + 8,000 + 50) / 40."""
    ramp = {"stamps": [0.2 * i for i in range(50)], "tokens": 50}
    tail = {"stamps": [30 + 0.2 * i for i in range(50)], "tokens": 50}
    steady = [{"stamps": [10 + 0.01 * i for i in range(2000)], "tokens": 2000} for _ in range(4)]
    tail["stamps"][-1] = 40.0
    assert math.isclose(middle_half_rate([ramp, *steady, tail]), 400.0)
    # several tokens a chunk: a chunk's tokens spread evenly over the request's chunks
    chunked = [{"stamps": r["stamps"][::4], "tokens": r["tokens"]} for r in steady]
    assert math.isclose(middle_half_rate([ramp, *chunked, tail]), 400.0)
    assert math.isnan(middle_half_rate([]))  # (every request failed: reported, not a crash)
