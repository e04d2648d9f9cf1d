"""``metrics.observe_many`` is ``observe()`` per amount, bucket for bucket.

The relay observes two lags per job in bulk (issue #20); what a scrape
shows must be exactly what one ``observe()`` per job showed: the same
bucket counts, count and sum, at the bounds themselves, for NaN and ±inf.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from duebox.metrics import observe_many

BOUNDS = (0.005, 0.01, 0.1, 1.0, 10.0)


def _samples(h: Histogram) -> dict[str, float]:
    return {f"{s.name}{s.labels.get('le', '')}": s.value
            for metric in h.collect() for s in metric.samples if not s.name.endswith("_created")}


def _pair() -> tuple[Histogram, Histogram]:
    return tuple(Histogram("lag", "lag", ["queue"], buckets=BOUNDS,  # type: ignore[return-value]
                           registry=CollectorRegistry()) for _ in range(2))


amounts = st.lists(st.sampled_from([*BOUNDS, 0.0, -0.0, math.inf, -math.inf, math.nan])
                   | st.floats(min_value=-1.0, max_value=100.0), max_size=60)


@settings(max_examples=300, deadline=None)
@given(amounts)
def test_bulk_is_one_observe_per_amount(values: list[float]) -> None:
    one, bulk = _pair()
    child = one.labels("q")
    for v in values:
        child.observe(v)
    observe_many(bulk.labels("q"), values)
    a, b = _samples(one), _samples(bulk)
    assert a.keys() == b.keys()
    for key in a:
        if key == "lag_sum":
            assert (math.isnan(a[key]) and math.isnan(b[key])) or math.isclose(
                a[key], b[key], rel_tol=1e-9, abs_tol=1e-9), key
        else:
            assert a[key] == b[key], key


class _Plain:
    """A histogram child without prometheus_client's insides."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def observe(self, amount: float) -> None:
        self.seen.append(amount)


def test_any_other_histogram_is_observed_one_amount_at_a_time() -> None:
    child = _Plain()
    observe_many(child, [3.0, 1.0, 2.0])
    assert child.seen == [3.0, 1.0, 2.0]
