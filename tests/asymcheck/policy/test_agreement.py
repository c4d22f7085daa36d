"""The preemption agreement over a real c10d store (asymcheck/policy/agreement.py), without training processes."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from asymcheck.policy.agreement import AgreedNotice, PreemptAgreement
from asymstore.dist.kv import KV


def tcp_pair() -> tuple[Any, Any]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10),  # type: ignore[attr-defined]
                           wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False,  # type: ignore[attr-defined]
                           timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    return server, client


def test_the_first_published_step_wins_and_every_rank_reads_it() -> None:
    server, client = tcp_pair()
    ranks = [PreemptAgreement(KV(dist.PrefixStore("asymstore/x", store)), "s1/preempt", r)  # type: ignore[attr-defined]
             for r, store in enumerate((server, client, client))]
    assert ranks[2].poll() is None and ranks[2].notice is None  # nothing published: a boundary reads nothing
    first = ranks[0].publish(7, "SIGTERM")
    assert first == AgreedNotice(7, 0, "SIGTERM")
    # a later publisher (its own SIGTERM a few ms later, one step further) adopts the first step
    assert ranks[1].publish(8, "SIGTERM") == first
    assert ranks[2].poll() == first and ranks[2].seen is not None
    assert ranks[2].publish(9, "explicit") == first  # known: nothing is written again


def test_sessions_do_not_see_each_others_notices() -> None:
    server, client = tcp_pair()
    old = PreemptAgreement(KV(server), "s1/preempt", 0)
    new = PreemptAgreement(KV(client), "s2/preempt", 1)
    assert old.publish(3, "explicit") == AgreedNotice(3, 0, "explicit")
    assert new.poll() is None and new.notice is None and new.lost is None  # read, and found nothing: not lost
    # the new session agrees on its own step, not the old session's 3; each session's readers see their own
    assert new.publish(5, "SIGTERM") == AgreedNotice(5, 1, "SIGTERM")
    assert PreemptAgreement(KV(server), "s2/preempt", 0).poll() == AgreedNotice(5, 1, "SIGTERM")
    assert PreemptAgreement(KV(client), "s1/preempt", 1).poll() == AgreedNotice(3, 0, "explicit")


def test_an_unreachable_store_is_recorded_as_lost() -> None:
    server, client = tcp_pair()
    agreement = PreemptAgreement(KV(client), "s1/preempt", 1)
    del server  # the store's server (rank 0's process) is gone
    import gc

    gc.collect()
    assert agreement.publish(4, "SIGTERM") is None
    assert agreement.lost is not None and agreement.notice is None
    assert agreement.poll() is None  # no more round trips once lost
