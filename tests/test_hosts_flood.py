"""A hostile flood across the link between two emulated hosts (issue 35).

A peer on another host can lie about anything a local one can; the
bounded queues and header checks of one host (tests/test_flood.py,
tests/test_fuzz.py) hold unchanged across TCP: host b floods host a with
20,000 unexpected 8 KiB active messages (156 MiB, past the 64 MiB cap)
while host c sends it malformed array headers and then a good array.
"""

from __future__ import annotations

import hosts as hostlib
import pytest
from test_fuzz import _HOSTILE

pytestmark = pytest.mark.timeout(120)

PEERS = str(hostlib.TESTS / "peers_hosts.py")
N = 20_000
SIZE = 8192
LIMIT = 256 << 20


@pytest.fixture
def three_hosts():
    with hostlib.hosts_or_skip(3) as made:
        yield made


def test_flood_and_malformed_arrays_from_other_hosts(three_hosts):
    """The survivor's resident memory grows by less than 256 MiB; the AM
    queue stays within its caps and counts its drops, with one
    DroppedMessagesWarning; every malformed array message is refused
    (``ValueError``) and the good array after them arrives; the flooder's
    tag message after the flood arrives; all over TCP."""
    a, b, c = three_hosts
    env = {"GPUCX_PEER_DEADLINE": "100"}
    surv = a.python(PEERS, "survivor", str(N), str(SIZE), str(len(_HOSTILE)), env=env)
    flood = b.python(PEERS, "flooder", "am", str(N), str(SIZE), env=env)
    arrays = c.python(PEERS, "hostile_arrays", env=env)
    _, addr = surv.get(60)
    flood.put(addr)
    surv.put(flood.get(60))  # the flooder's address; it connects to ours
    arrays.put(list(_HOSTILE))
    arrays.put(addr)
    surv.put(arrays.get(60))
    assert flood.get(100) == "flooded"
    surv.put("flooded")
    done, growth, stats, drops, got, good_ok, after, transports = surv.get(60)
    assert done == "done"
    assert growth < LIMIT, f"RSS grew by {growth >> 20} MiB"
    assert stats["dropped"] > 0, stats
    assert stats["max_count"] > 0 and stats["count"] <= stats["max_count"], stats
    assert stats["max_bytes"] > 0 and stats["bytes"] <= stats["max_bytes"], stats
    assert stats["count"] + stats["dropped"] == N - 1, stats
    assert len(drops) == 1, drops
    assert len(got) == len(_HOSTILE)
    assert all("malformed" in g for g in got), got
    assert good_ok
    assert after == "after the flood"
    for ep in transports:
        assert {name for name, _ in ep} == {"tcp"}, transports
    surv.put(None)
    flood.put("bye")
    arrays.put("done")
    for p in (surv, flood, arrays):
        p.join(30)
