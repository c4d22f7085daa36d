"""StoreTransport between two real stores over its real socket: what arrives is the committed version, verified.

The Manager here is a small stand-in with the three public methods the transport uses (the heal
itself under torchft's own Manager and lighthouse is in test_heal.py); faults are injected by a
byte flipped on disk, a proxy that flips a byte in flight, and servers that stall or lie.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

from asymstore import AsymStore, LocalTier, host_tier
from asymstore.errors import (
    HealCorruptError,
    HealError,
    HealProtocolError,
    HealTimeoutError,
    HealVersionMissingError,
)
from asymstore.torchft import StoreTransport
from asymstore.torchft.transport import KEY

T5 = timedelta(seconds=5)


class Counters:
    """The public methods of torchft's Manager the transport calls, over a plain step counter."""

    def __init__(self) -> None:
        self.step = 0
        self.fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}

    def current_step(self) -> int:
        return self.step

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": 2 * self.step}

    def register_state_dict_fn(self, key: str, load: Callable[[Any], None], state: Callable[[], Any]) -> None:
        self.fns[key] = (load, state)


class Position:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


class Group:
    """A replica group's model, optimizer, position and transport."""

    def __init__(self, name: str, tiers: list[Any]) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(6, 3)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.1)
        self.manager = Counters()
        self.position = Position()
        store = AsymStore(tiers, calibration_cache=False, segment_bytes=1 << 20, compression="never")
        self.transport = StoreTransport(store, replica_group=name, timeout=T5)
        self.transport.attach(self.manager, {"default": self.state}, position=self.position)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def train(self) -> None:
        self.opt.zero_grad()
        self.model(torch.randn(4, 6)).square().mean().backward()
        self.opt.step()
        self.manager.step += 1
        self.position.n += 1


@pytest.fixture
def groups(tmp_path: Path) -> Iterator[Callable[..., Group]]:
    made: list[Group] = []

    def make(name: str, tiers: list[Any] | None = None) -> Group:
        g = Group(name, tiers if tiers is not None else [host_tier(1 << 24, name="memory")])
        made.append(g)
        return g

    yield make
    for g in made:
        g.transport.shutdown()


def _trained(make: Callable[..., Group], steps: int = 2, tiers: list[Any] | None = None) -> Group:
    a = make("a", tiers)
    a.transport.save()
    for _ in range(steps):
        a.train()
        a.transport.save()
    return a


def test_recv_is_the_committed_version_not_the_live_state(groups: Callable[..., Group]) -> None:
    """Training goes on after the step torchft asks for: the healer gets that step's version, from memory."""
    a = _trained(groups)
    committed = {k: v.clone() for k, v in a.model.state_dict().items()}
    rng = torch.get_rng_state()
    a.transport.send_checkpoint([1], 2, a.state(), T5)
    a.train()  # the live state moves on (torchft would not block it: disallow_checkpoint holds nothing)
    a.transport.disallow_checkpoint()
    b = groups("b")
    out = b.transport.recv_checkpoint(0, a.transport.metadata(), 2, T5)
    assert out["torchft"] == {"step": 2, "batches_committed": 4}
    for k, v in out["user"]["default"]["model"].items():
        assert torch.equal(v, committed[k]) and not torch.equal(v, a.model.state_dict()[k])
    assert out["user"]["default"]["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert b.transport.healed is not None and b.transport.healed.source_tier == "memory"
    assert b.transport.healed.source_group == "a" and b.transport.healed.step == 2
    # the group's record (RNG states, data position) travels and is put back by the registered callback
    torch.manual_seed(123)
    b.manager.fns[KEY][0](out["user"][KEY])
    assert b.position.n == 2
    assert torch.equal(torch.get_rng_state(), rng)


def test_missing_version_is_typed(groups: Callable[..., Group]) -> None:
    a = _trained(groups)
    with pytest.raises(HealVersionMissingError):
        a.transport.send_checkpoint([1], 7, a.state(), T5)
    b = groups("b")
    with pytest.raises(HealVersionMissingError):
        b.transport.recv_checkpoint(0, a.transport.metadata(), 7, T5)
    assert b.transport.healed is None


def test_corrupt_segment_on_the_serving_tier_is_refused(groups: Callable[..., Group], tmp_path: Path) -> None:
    """A byte flipped in the version the healthy group serves (its disk copy): refused, nothing returned."""
    a = _trained(groups, tiers=[LocalTier(tmp_path / "a")])
    a.transport.send_checkpoint([1], 2, a.state(), T5)  # waits for the step's commit
    seg = max((tmp_path / "a" / "v000000000002").glob("seg-*"), key=lambda p: p.stat().st_size)
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x10
    seg.write_bytes(bytes(data))
    b = groups("b")
    with pytest.raises(HealCorruptError):
        b.transport.recv_checkpoint(0, a.transport.metadata(), 2, T5)
    assert b.transport.healed is None


class FlipProxy:
    """Forwards each connection to ``upstream`` and flips one byte of every segment answer's payload."""

    def __init__(self, upstream: str, where: Callable[[dict[str, Any]], bool]) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.where = where
        self.flipped = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, socket.create_connection(self.upstream) as up:
                req = conn.makefile("rb").readline()
                up.sendall(req)
                answer = bytearray()
                while chunk := up.recv(1 << 16):
                    answer += chunk
                head, _, body = answer.partition(b"\n")
                if body and self.where(json.loads(req)):
                    body[len(body) // 2] ^= 0x01
                    self.flipped += 1
                conn.sendall(bytes(head) + b"\n" + bytes(body))

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("op", ["segment", "manifest"])
def test_bytes_flipped_in_flight_are_refused(groups: Callable[..., Group], op: str) -> None:
    """A peer's bad bytes (one bit flipped between the groups): HealCorruptError, never a wrong state."""
    a = _trained(groups)
    proxy = FlipProxy(a.transport._server.address, lambda req: req["op"] == op)
    try:
        meta = json.dumps({"addr": proxy.address, "group": "a"})
        b = groups("b")
        with pytest.raises(HealCorruptError):
            b.transport.recv_checkpoint(0, meta, 2, T5)
        assert proxy.flipped >= 1 and b.transport.healed is None
        # the same version through no proxy arrives whole
        assert b.transport.recv_checkpoint(0, a.transport.metadata(), 2, T5)["torchft"]["step"] == 2
    finally:
        proxy.close()


def _fake_server(answer: bytes | None) -> tuple[socket.socket, str]:
    """A server that reads one request and answers ``answer`` (None: never answers)."""
    sock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        held = []
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.makefile("rb").readline()
            if answer is None:
                held.append(conn)  # keep it open, say nothing
            else:
                with conn:
                    conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return sock, json.dumps({"addr": f"127.0.0.1:{sock.getsockname()[1]}", "group": "x"})


def test_a_stalled_peer_times_out(groups: Callable[..., Group]) -> None:
    sock, meta = _fake_server(None)
    try:
        b = groups("b")
        started = time.monotonic()
        with pytest.raises(HealTimeoutError):
            b.transport.recv_checkpoint(0, meta, 1, timedelta(seconds=1))
        assert time.monotonic() - started < 3
    finally:
        sock.close()


@pytest.mark.parametrize("answer", [
    b'{"ok": true, "size": 1099511627776, "tier": "memory"}\n',  # a manifest of 1 TiB: refused unread
    b"not json\n",
    b'{"ok": "yes"}\n',
    b"x" * 20000,  # an endless line
])
def test_a_lying_peer_is_refused_within_bounds(groups: Callable[..., Group], answer: bytes) -> None:
    sock, meta = _fake_server(answer)
    try:
        b = groups("b")
        with pytest.raises((HealCorruptError, HealProtocolError)):
            b.transport.recv_checkpoint(0, meta, 1, T5)
    finally:
        sock.close()


def test_a_peer_that_is_gone_is_a_heal_error(groups: Callable[..., Group]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        meta = json.dumps({"addr": f"127.0.0.1:{sock.getsockname()[1]}", "group": "x"})
    b = groups("b")
    with pytest.raises(HealError) as info:
        b.transport.recv_checkpoint(0, meta, 1, T5)
    assert type(info.value) is HealError and b.transport.healed is None


@pytest.mark.parametrize("meta", ["", "{", '{"addr": 5, "group": "a"}', '{"addr": "nohost", "group": "a"}',
                                  "x" * 5000])
def test_malformed_metadata_is_refused(groups: Callable[..., Group], meta: str) -> None:
    b = groups("b")
    with pytest.raises(HealProtocolError):
        b.transport.recv_checkpoint(0, meta, 1, T5)


def test_a_repeated_step_is_not_saved_again(groups: Callable[..., Group]) -> None:
    """torchft did not commit (the optimizer did not step): the step's version is the first one saved."""
    a = _trained(groups, steps=1)
    assert a.transport.save() is None
    a.train()
    assert a.transport.save() == 2


def test_a_failed_commit_stays_out_of_training_and_is_not_served(groups: Callable[..., Group]) -> None:
    """The memory tier refuses the version (too small): save() goes on, the step cannot be served (typed)."""
    a = groups("a", [host_tier(2048, name="memory", policy="skip")])
    assert a.transport.save() == 0
    a.train()
    assert a.transport.save() == 1  # the refusal of step 0 is logged here, not raised
    with pytest.raises(HealVersionMissingError):
        a.transport.send_checkpoint([1], 1, a.state(), T5)
