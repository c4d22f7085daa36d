"""The peer link's lanes (a group per flow in a ring of two nodes) and its frames received ahead.

In a ring of two nodes each pair of ranks carries both flows, and gloo queues a receiver's "ready"
notices behind the bulk going the same way, so each node's flow gets a group of its own; a reader
that knows another frame follows posts that frame's first receive early. What must hold: both ends
of a flow pick the same group, the two flows of a pair never share one, frames read ahead arrive
whole and in order (payloads and inline frames mixed), and a receive posted ahead that nobody takes
never keeps the link from ending. Ranks are threads with real gloo groups over a shared HashStore.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch
import torch.distributed as dist

from asymstore.tiers.peer.link import CHUNK, FRAME, TAG_ACK, TAG_REPL, TAG_REQ, TAG_RESP, PeerLink, connect
from asymstore.tiers.peer.ring import lanes_of, ring_of
from tests.support.ranks import run_ranks


def test_two_nodes_get_a_lane_each_and_more_nodes_one_group() -> None:
    assert lanes_of(ring_of(0, 2, node_of=[0, 1])) == [0, 1]
    assert lanes_of(ring_of(0, 4, node_of=[5, 5, 2, 2])) == [1, 1, 0, 0]  # by node, not by rank parity
    assert lanes_of(ring_of(0, 6, local_world_size=2)) is None  # three nodes: a pair carries one flow


def test_both_ends_of_a_flow_agree_on_its_group_and_a_pairs_two_flows_never_share_one() -> None:
    node_of = [0, 0, 1, 1]
    lanes = lanes_of(ring_of(0, 4, node_of=node_of))
    assert lanes is not None
    links = {r: PeerLink(["group-0", "group-1"], r, 1.0, lanes) for r in range(4)}
    for src in range(4):
        dst = ring_of(src, 4, node_of=node_of).dst
        a, b = links[src], links[dst]
        for out_tag, back_tag in ((TAG_REPL, TAG_ACK), (TAG_REQ, TAG_RESP)):
            flow = a.group(dst, out_tag, True)
            assert b.group(src, out_tag, False) == flow  # the source's frames, where the holder reads them
            assert b.group(src, back_tag, True) == flow  # its answers back, on the same flow
            assert a.group(dst, back_tag, False) == flow
            assert b.group(src, out_tag, True) != flow  # the holder's own flow to the source: the other group


def test_frames_read_ahead_arrive_whole_and_in_order_and_the_next_is_asked_for_early() -> None:
    kv = dist.HashStore()
    big = torch.randint(0, 256, (3 * CHUNK // 2,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    # a small part (gathered into a copy) and two large ones (sent from their memory, the last in two messages)
    parts = [big[:5000], big[5000:3 << 20], big[3 << 20:]]
    frames: list[tuple[dict[str, Any], list[torch.Tensor]]] = [
        ({"op": "a"}, parts),
        ({"op": "b"}, [torch.full((100,), 7, dtype=torch.uint8)]),  # inline
        ({"op": "c"}, [big[:FRAME]]),  # one payload message
        ({"op": "d"}, []),
    ]

    def rank_fn(rank: int) -> Any:
        link = connect(kv, rank, 2, 1, 20.0, lanes=[0, 1])
        try:
            if rank == 0:
                for header, payload in frames:
                    link.send(1, TAG_REQ, header, [p.numpy() for p in payload])
                return link.recv_header(1, TAG_RESP)[0]["op"]
            got = []
            for i, (_, payload) in enumerate(frames):
                header, inline = link.recv_header(0, TAG_REQ)
                out = torch.empty(sum(p.numel() for p in payload), dtype=torch.uint8)
                with link.reading_ahead(0, TAG_REQ, i + 1 < len(frames)):
                    link.payload(0, TAG_REQ, header, inline, memoryview(out.numpy()))
                    asked = len(link._posted.get((0, TAG_REQ), ()))
                got.append((header["op"], asked, torch.equal(out, torch.cat(payload) if payload else out)))
            link.send(0, TAG_RESP, {"op": "done"})
            return got
        finally:
            assert link.end("the test is over", 1.0, 5.0)

    out = run_ranks(2, lambda rank: asyncio.to_thread(rank_fn, rank))
    # a frame with a payload has the next one's receive posted before its own payload has arrived
    assert out == {0: "done", 1: [("a", 1, True), ("b", 0, True), ("c", 1, True), ("d", 0, True)]}, out


def test_a_receive_posted_ahead_that_nobody_takes_never_holds_up_the_end() -> None:
    kv = dist.HashStore()

    def rank_fn(rank: int) -> Any:
        link = connect(kv, rank, 2, 1, 20.0, lanes=[0, 1])
        if rank == 1:
            link.post_header(0, TAG_REPL)  # a frame that will never come
            link.post_header(0, TAG_REQ)
        t0 = time.monotonic()
        clean = link.end("the test is over", 0.0, 5.0)
        return clean, time.monotonic() - t0, sum(len(q) for q in link._posted.values())

    out = run_ranks(2, lambda rank: asyncio.to_thread(rank_fn, rank))
    for rank in (0, 1):
        clean, seconds, left = out[rank]
        assert clean and seconds < 5.0 and left == 0, out
