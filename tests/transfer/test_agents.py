"""Both transfer agents between two processes on loopback: pages land byte for byte, faults surface.

The NIXL tests skip, naming the import error, only when the engine cannot be imported.
"""
from __future__ import annotations

import numpy as np
import pytest

from tensorrt_llm_draftkv.transfer import nixl_unavailable, use_loopback

from transfer.pair import LAYERS, PAGES, Step, _layers, run_pair

use_loopback()  # UCX_NET_DEVICES=lo and a tcp-including UCX_TLS for the ranks this module spawns
NIXL_MISSING = nixl_unavailable()
needs_nixl = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL transport tests skipped: {NIXL_MISSING}")
TRANSPORTS = [pytest.param("nixl", marks=needs_nixl), "torch"]

PLAN = [
    Step("req:0", (0, 1, 2, 3, 9), (40, 41, 42, 3, 4)),  # two runs and a lone page
    Step("req:1", (20, 22, 24), (5, 6, 7)),  # no run on the source side
    Step("req:2", tuple(range(30, 62)), tuple(range(10, 42))),  # one run of 32 pages (overwrites req:0's)
]


def _expected(plan: list[Step]) -> list[np.ndarray]:
    """Rank 1's layers after the plan, computed here from both ranks' seeded contents."""
    src, dst = _layers(100), _layers(101)
    for step in plan:
        if step.fault in ("bad_desc", "exit"):  # nothing written (a missing sync message still writes)
            continue
        for s, d in zip(src, dst):
            d[list(step.dst_pages)] = s[list(step.src_pages)]
    return [t.numpy().view(np.uint8).reshape(-1) for t in dst]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pages_land_byte_for_byte(transport):
    result = run_pair(transport, PLAN)
    assert result.outcomes == {s.name: "ok" for s in PLAN}
    assert result.sender_outcomes == {s.name: "ok" for s in PLAN}
    want = _expected(PLAN)
    assert len(result.pools) == LAYERS
    for got, exp in zip(result.pools, want):
        assert np.array_equal(got, exp)
    untouched = _layers(101)[0].numpy().view(np.uint8).reshape(PAGES, -1)
    assert not np.array_equal(result.pools[0].reshape(PAGES, -1)[40], untouched[40])  # a page that changed


@needs_nixl
def test_both_transports_leave_the_same_bytes():
    nixl, torch_wire = run_pair("nixl", PLAN), run_pair("torch", PLAN)
    for a, b in zip(nixl.pools, torch_wire.pools):
        assert np.array_equal(a, b)


@needs_nixl
def test_nixl_notification_that_never_comes_times_out_and_the_next_request_lands():
    plan = [Step("req:0", (1, 2), (3, 4), fault="no_sync"), Step("req:1", (5,), (6,))]
    result = run_pair("nixl", plan, timeout_s=3.0)
    assert result.outcomes == {"req:0": "TransferTimeout", "req:1": "ok"}
    assert all(np.array_equal(g, e) for g, e in zip(result.pools, _expected(plan)))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_descriptor_outside_registered_memory_is_refused_and_the_next_request_lands(transport):
    plan = [Step("req:0", (1, 2), (3, 4), fault="bad_desc"), Step("req:1", (5,), (6,))]
    result = run_pair(transport, plan, timeout_s=3.0)
    if transport == "nixl":  # the engine refuses to post it; nothing is sent, the receiver times out
        assert result.sender_outcomes["req:0"] == "TransferError"
        assert result.outcomes["req:0"] == "TransferTimeout"
    else:  # the wire carries it; the receiver refuses to scatter it
        assert result.outcomes["req:0"] == "TransferError"
    assert result.outcomes["req:1"] == "ok"
    assert all(np.array_equal(g, e) for g, e in zip(result.pools, _expected(plan[1:])))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_peer_that_disappears_is_an_error_not_a_hang(transport):
    plan = [Step("req:0", (1,), (2,)), Step("req:1", (3,), (4,), fault="exit")]
    result = run_pair(transport, plan, timeout_s=3.0)
    assert result.outcomes["req:0"] == "ok"
    assert result.outcomes["req:1"] in ("TransferTimeout", "PeerGone")
