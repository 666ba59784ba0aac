"""ShardSuspects (kvstore/client/shard_health.py): which shards a client skips for now.

A node failure makes a shard suspect; while suspect its calls fail at once; after the
hold a TCP probe decides (closed: skipped again, open: tried); a success clears it;
a request's own error (a bad key, a full tier) never makes a shard suspect.
"""

from __future__ import annotations

import pytest

from kvstore.client.shard_health import HURRIED_STRIKES, STRIKE_S, ShardSuspects
from kvstore.errors import (
    CapacityError,
    InvalidKey,
    TimeoutError_,
    TransportError,
    Unavailable,
)
from kvstore.observe.counters import NodeCounters


class Probe:
    """A stand-in for the TCP probe: answers what the test says, counts the calls."""

    def __init__(self) -> None:
        self.open = False
        self.calls: list[str] = []

    def __call__(self, address: str) -> bool:
        self.calls.append(address)
        return self.open


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


CLOCK = Clock()


def suspects(hold_s: float = 1.0) -> tuple[ShardSuspects, Probe, NodeCounters]:
    probe, counters = Probe(), NodeCounters()
    s = ShardSuspects("g", ["h:1", "h:2"], probe, counters, hold_s, clock=CLOCK)
    return s, probe, counters


NODE_FAILURES = [Unavailable("gone"), TransportError("reset"), TimeoutError_("slow")]


@pytest.mark.parametrize(
    "exc", [Unavailable("gone"), TransportError("reset"), TimeoutError_("slow")]
)
def test_a_node_failure_skips_the_shard_until_a_probe_finds_it(exc: Exception) -> None:
    s, probe, counters = suspects()
    s.check(1)  # nothing known: tried
    s.failed(1, exc)  # type: ignore[arg-type]
    with pytest.raises(Unavailable, match=r"shard 1 of node 'g' \(h:2\) is down"):
        s.check(1)
    s.check(0)  # the other shard is untouched
    assert probe.calls == [] and s.suspects() == {1}
    CLOCK.now += 1.5
    with pytest.raises(Unavailable):  # the hold is over, but the port is still closed
        s.check(1)
    assert probe.calls == ["h:2"] and s.suspects() == {1}
    CLOCK.now += 1.5
    probe.open = True
    s.check(1)  # open again: tried
    s.succeeded(1)
    assert s.suspects() == set()
    s.check(1)
    assert probe.calls == ["h:2", "h:2"]  # no probe once it answered
    assert counters.get("shard_failures") == 1 and counters.get("shard_skipped") == 2


def test_a_requests_own_error_never_makes_a_shard_suspect() -> None:
    s, _, counters = suspects()
    s.failed(0, InvalidKey("bad key"))
    s.failed(0, CapacityError("full"))
    s.check(0)
    assert s.suspects() == set() and counters.snapshot() == {}


def test_a_failure_while_suspect_counts_once_and_extends_the_hold() -> None:
    s, _, counters = suspects(hold_s=10.0)
    s.failed(0, Unavailable("a"))
    s.failed(0, Unavailable("b"))
    with pytest.raises(Unavailable, match=r"\(b\)"):
        s.check(0)
    assert counters.get("shard_failures") == 1


def test_after_the_hold_one_caller_probes_and_tries_the_others_still_fail_fast() -> None:
    """Half-open: once the hold is over, the first check probes and its call is the
    trial; checks before that call's outcome fail at once (no probe each); a success
    clears the shard, and a trial that only hit a request error waits a hold."""
    s, probe, _ = suspects()
    s.failed(0, Unavailable("gone"))
    CLOCK.now += 1.5
    probe.open = True
    s.check(0)  # the trial
    for _ in range(4):
        with pytest.raises(Unavailable):
            s.check(0)
    assert probe.calls == ["h:1"]
    s.succeeded(0)
    s.check(0)
    assert s.suspects() == set() and probe.calls == ["h:1"]


def test_a_probe_that_fails_does_not_undo_a_success_meanwhile() -> None:
    """A's probe is slow and finds the port closed; B's call succeeded while it ran:
    the shard stays cleared."""
    import threading

    started, go = threading.Event(), threading.Event()

    def slow_closed(address: str) -> bool:
        started.set()
        go.wait(5)
        return False

    s = ShardSuspects("g", ["h:1"], slow_closed, NodeCounters(), 1.0, clock=CLOCK)
    s.failed(0, Unavailable("gone"))
    CLOCK.now += 1.5
    errors: list[BaseException] = []

    def a() -> None:
        try:
            s.check(0)
        except Unavailable as exc:
            errors.append(exc)

    t = threading.Thread(target=a)
    t.start()
    assert started.wait(5)
    s.succeeded(0)  # B
    go.set()
    t.join(5)
    assert len(errors) == 1  # A's own call was refused by its probe
    assert s.suspects() == set()
    s.check(0)  # and everyone else goes on


def test_hurried_timeouts_make_a_shard_suspect_only_in_a_row() -> None:
    """A timeout under a caller's shorter deadline is a strike: one is forgiven (the
    caller's hurry), two in a row are a shard that does not answer (a hung one, seen
    through a cluster client's deadline shares); a success in between forgives."""
    s, _, counters = suspects()
    s.failed(0, TimeoutError_("slow"), hurried=True)
    s.check(0)  # not suspect
    s.succeeded(0)
    s.failed(0, TimeoutError_("slow"), hurried=True)
    s.check(0)  # the success in between wiped the first strike
    s.failed(0, TimeoutError_("slow"), hurried=True)
    with pytest.raises(Unavailable):
        s.check(0)
    assert counters.get("shard_failures") == 1
    s.failed(1, TransportError("reset"), hurried=True)  # not a timeout: at once
    with pytest.raises(Unavailable):
        s.check(1)


def test_a_strike_expires() -> None:
    """Two hurried timeouts far apart, with no call between to succeed, are a busy
    shard's bad moments, not a hung shard: the older strike has expired."""
    clock = Clock()
    s = ShardSuspects("g", ["h:1"], Probe(), NodeCounters(), 1.0, clock=clock)
    s.failed(0, TimeoutError_("slow"), hurried=True)
    clock.now += STRIKE_S + 0.5
    s.failed(0, TimeoutError_("slow"), hurried=True)
    s.check(0)  # one live strike: not suspect
    clock.now += STRIKE_S / 2
    s.failed(0, TimeoutError_("slow"), hurried=True)  # two within STRIKE_S of each other
    with pytest.raises(Unavailable):
        s.check(0)


def test_strikes_count_from_each_calls_start() -> None:
    """A hung shard called one call at a time under a long hurried deadline (a cluster
    client's share of 10 s): each strike ends over STRIKE_S after the last, yet each
    call started right after it, so they are in a row and the shard is held."""
    clock = Clock()
    s = ShardSuspects("g", ["h:1"], Probe(), NodeCounters(), 1.0, clock=clock)
    for _ in range(HURRIED_STRIKES):
        started = clock.now
        clock.now += STRIKE_S + 1.0  # the call's whole deadline, spent
        s.failed(0, TimeoutError_("slow"), hurried=True, started=started)
    with pytest.raises(Unavailable):
        s.check(0)
