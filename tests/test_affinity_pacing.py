"""Under session affinity sluice paces its weights: a minute moves at most `MOVED_PER_MINUTE` of the traffic between
the pods that stay routable, since a hash ring moves a session whenever its pod's share moves and its prefix cache
stays behind (docs/design.md, "Sessions and prefix caches"). Protective moves are not paced."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from sluice.core.allocation import MOVED_PER_MINUTE
from sluice.core.observed import PodSignals
from sluice.core.weights import slew
from tests.helpers import pod, run, spec, weights

PODS = [pod("h100-0", "h100"), pod("a100-0", "a100"), pod("a100-1", "a100")]
CAPACITY = {"classes": {"h100": 16.0, "a100": 10.0}}
MOVED_PER_PASS = MOVED_PER_MINUTE * 5 / 60  # the spec's default interval


def _sig(rps: float, p95: float, queue: float = 0.0, errors: float = 0.0) -> PodSignals:
    return PodSignals(
        ttft_seconds=p95 / 1.5,
        ttft_p95_seconds=p95,
        kv_cache_usage=0.3,
        queue_length=queue,
        running_requests=10.0,
        request_rate=rps,
        error_rate=errors,
    )


CALM = {"h100-0": _sig(8.0, 0.3), "a100-0": _sig(4.0, 0.3), "a100-1": _sig(4.0, 0.3)}
SLOWER = {**CALM, "h100-0": _sig(8.0, 1.2)}
QUEUED = {**CALM, "h100-0": _sig(8.0, 2.5, queue=20.0)}


def _shares(w: dict[str, int]) -> dict[str, float]:
    total = sum(w.values())
    return {name: weight / total for name, weight in w.items()}


def _moved(a: dict[str, int], b: dict[str, int]) -> float:
    sa, sb = _shares(a), _shares(b)
    return 0.5 * sum(abs(sa[n] - sb[n]) for n in sa)


def _h100_shares(affinity: bool, later: dict[str, PodSignals]) -> tuple[list[dict[str, int]], list[str]]:
    routing = {"sessionAffinity": {"header": "x-session-id"}} if affinity else {}
    s = spec(scoring={"policy": "headroom"}, routing=routing, capacity=CAPACITY)
    status, published, reasons = None, [], []
    for i in range(14):
        result = run(s, PODS, CALM if i < 6 else later, 5 * i, status)
        status = result.status
        published.append(weights(result))
        reasons.append(" | ".join(r.reason for r in status.endpoints))
    return published, reasons


def test_a_large_move_is_spread_over_passes_under_affinity_and_published_at_once_without() -> None:
    paced, reasons = _h100_shares(True, SLOWER)
    free, _ = _h100_shares(False, SLOWER)
    steps = [_moved(a, b) for a, b in itertools.pairwise(paced[5:])]
    assert max(steps) <= MOVED_PER_PASS + 0.005  # integer weights
    assert sum(1 for step in steps if step > MOVED_PER_PASS / 2) >= 3  # a move of ~0.2 takes several passes
    assert _shares(paced[-1])["h100-0"] < _shares(paced[5])["h100-0"] - 0.15  # and gets there
    assert _moved(free[5], free[6]) > 3 * MOVED_PER_PASS  # without affinity, the first pass moves it all
    assert "of the traffic moves a minute" in reasons[6]


def test_an_overload_is_shed_at_once_under_affinity() -> None:
    paced, _ = _h100_shares(True, QUEUED)
    assert _moved(paced[5], paced[6]) > 3 * MOVED_PER_PASS  # a queue on a paced pod: the whole move, this pass


def test_a_failing_pod_is_zeroed_at_once_under_affinity() -> None:
    failing = {**CALM, "a100-1": _sig(4.0, 0.3, errors=0.9)}
    paced, _ = _h100_shares(True, failing)
    assert paced[6]["a100-1"] == 0


@given(
    st.lists(st.integers(1, 1000), min_size=2, max_size=6).flatmap(
        lambda before: st.tuples(
            st.just(before), st.lists(st.integers(1, 1000), min_size=len(before), max_size=len(before))
        )
    ),
    st.floats(0.01, 0.5),
)
def test_slew_moves_at_most_its_bound_and_toward_the_wish(pair: tuple[list[int], list[int]], most: float) -> None:
    before = {f"p{i}": w for i, w in enumerate(pair[0])}
    wanted = {f"p{i}": w for i, w in enumerate(pair[1])}
    out = slew(before, wanted, most, 1000)
    assert max(out.values()) <= 1000
    assert min(out.values()) >= 1
    total = _moved(before, wanted)
    if total <= most:
        assert out == wanted
    else:
        rounding = len(out) / sum(out.values())  # each weight within 0.5 of its exact value
        assert _moved(before, out) <= most + rounding
        assert _moved(out, wanted) <= total - most + rounding
