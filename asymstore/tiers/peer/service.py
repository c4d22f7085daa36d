"""The receiving end of a peer tier: replicas of one source rank, verified on arrival, served back on request.

The service runs its own event loop on a thread, with the replica tier (a bounded
:func:`~asymstore.tiers.memory.factory.host_tier`) on it, and two loops: **receive** (``REPL``:
``begin``, ``segment``, ``manifest``, ``delete``, ``probe``) checks every segment's checksum and the
manifest before the replica is published atomically, then acknowledges it; a version that does not
verify is aborted, so no half replica is ever listed. **serve** (``REQ``: ``list``, ``manifest``,
``segment``, ``ranges``) answers on ``RESP`` in the order asked, sending from the tier's own memory
where it lends it (:class:`~asymstore.tiers.protocol.ViewTier`). Both end on ``bye`` or a failed
link; a failure is logged and kept in :attr:`ReplicaService.last_error` (shown by the peer tier's
``status()``), and the service stops before interpreter exit (:mod:`asymstore.runtime.exiting`).

The replication protocol and its frames: docs/guides/multirank.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, NoReturn

from asymstore.errors import AsymstoreError, CorruptVersionError, PeerError, describe
from asymstore.format.checksum import StreamingChecksum
from asymstore.format.manifest import MAX_MANIFEST_BYTES
from asymstore.format.parse import parse_manifest
from asymstore.runtime.exiting import EXIT_WAIT_S, at_exit, cancel
from asymstore.tiers.peer.link import TAG_ACK, TAG_REPL, TAG_REQ, TAG_RESP, PeerLink, blocking, in_thread
from asymstore.tiers.protocol import Buffer, Tier, VersionWriter, ViewTier

logger = logging.getLogger(__name__)

MAX_PROBE_BYTES = 64 << 20
"""A calibration probe's payload at most (the store probes with 8 MiB); a larger one is a protocol violation."""


class ReplicaService:
    """Holds ``src``'s replicas in ``tier`` and answers ``src``'s requests, on a thread of its own.

    Args:
        link: the replication link.
        src: the rank whose versions this rank holds.
        tier: where the replicas live (opened and used only by the service).
        keep: replicas kept (older ones are deleted after each new one).
    """

    def __init__(self, link: PeerLink, src: int, tier: Tier, keep: int = 2) -> None:
        """Configure; ``start`` runs it."""
        self.link, self.src, self.tier, self.keep = link, src, tier, keep
        self.received = 0
        self.refused = 0
        self.last_error: str | None = None
        self._recv = bytearray()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"asymstore-replicas-of-{src}", daemon=True)
        self._opened = threading.Event()
        self._open_error: BaseException | None = None
        self._done: asyncio.Future[Any] | None = None
        self._exit_handle: int | None = None

    # -- lifecycle -------------------------------------------------------

    def start(self) -> None:
        """Open the replica tier and start receiving and serving (blocks until the tier is open)."""
        self._exit_handle = at_exit(self._at_exit)
        self._thread.start()
        self._opened.wait()
        if self._open_error is not None:
            self._thread.join()
            cancel(self._exit_handle)
            self._exit_handle = None
            raise self._open_error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # never the thread's excepthook: logged, and kept for status()
            self.last_error = describe(exc)
            logger.error("replicas of rank %d: the service stopped: %s", self.src, self.last_error, exc_info=exc)
        finally:
            self._opened.set()

    async def _main(self) -> None:
        try:
            await self.tier.open()
        except BaseException as exc:
            self._open_error = exc
            self._opened.set()
            return
        self._opened.set()
        try:
            self._done = asyncio.gather(self._guard("receive", self._receive),
                                        self._guard("serve", self._serve))
            await self._done
        except asyncio.CancelledError:
            pass
        finally:
            await self.tier.close()

    async def _guard(self, what: str, loop: Callable[[], Awaitable[None]]) -> None:
        try:
            await loop()
        except (PeerError, OSError) as exc:
            self.last_error = describe(exc)
            logger.warning("replicas of rank %d: %s loop ended: %s", self.src, what, exc)
        except Exception as exc:
            self.last_error = describe(exc)
            logger.error("replicas of rank %d: %s loop failed: %s", self.src, what, self.last_error, exc_info=exc)

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the source's ``bye``, then stop (blocking; idempotent)."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.info("replicas of rank %d: no bye from it in %g s; stopping", self.src, timeout_s)
                self._cancel(10.0)
        if not self._thread.is_alive():
            cancel(self._exit_handle)
            self._exit_handle = None

    def _cancel(self, timeout_s: float) -> None:
        done = self._done
        if done is not None:
            self._loop.call_soon_threadsafe(done.cancel)
        self._thread.join(timeout_s)

    def _at_exit(self) -> None:
        """The interpreter exits: stop receiving and serving now (the replica tier is closed; bounded wait)."""
        if self._thread.is_alive():
            self._cancel(EXIT_WAIT_S)

    # -- receiving -------------------------------------------------------

    def _read_header(self, tag: int) -> tuple[dict[str, Any], bytes | None]:
        """Receive a frame's first message (blocking); once a frame is whole, the next one's is posted.

        Every frame but ``bye`` is followed by another on its stream (or the link fails), so the next
        first message is asked for at once, not after this frame is handled: gloo sends it only once asked.
        A frame with a payload posts it when its payload's receives are (:meth:`_take`).
        """
        header, inline = self.link.recv_header(self.src, tag)
        if inline is not None and header.get("op") != "bye":
            self.link.post_header(self.src, tag)
        return header, inline

    def _take(self, header: dict[str, Any], inline: bytes | None, into: memoryview | None) -> None:
        """Receive a ``REPL`` frame's payload into ``into`` (None: drop it).

        The next frame's first message is posted as soon as this payload's receives are; a frame that came
        whole (inline) had it posted by :meth:`_read_header` already.
        """
        with self.link.reading_ahead(self.src, TAG_REPL, enabled=inline is None):
            if into is None:
                self.link.discard(self.src, TAG_REPL, header, inline)
            else:
                self.link.payload(self.src, TAG_REPL, header, inline, into)

    async def _header(self, tag: int) -> tuple[dict[str, Any], bytes | None]:
        while True:
            header, inline = await blocking(partial(self._read_header, tag))
            if header.get("op") != "ping":
                return header, inline

    async def _receive(self) -> None:
        while True:
            header, inline = await self._header(TAG_REPL)
            if header.get("op") == "bye":
                return
            if header.get("op") == "delete":
                await self._delete(header.get("step"))
                continue
            if header.get("op") == "probe":
                await self._probe(header, inline)
                continue
            await self._receive_version(header, inline)

    def _protocol(self, what: str) -> NoReturn:
        raise self.link.violated(f"rank {self.src}: {what}")

    async def _receive_version(self, header: dict[str, Any], inline: bytes | None) -> None:
        """Receive the frames of one version, ``header`` (with ``inline``) the first; every frame names the step."""
        step, reserve = header.get("step"), header.get("reserve")
        if not isinstance(step, int) or not isinstance(reserve, int) or reserve < 0:
            self._protocol(f"a version frame without step and reservation: {str(header)[:200]}")
        writer: VersionWriter | None = None
        refusal: str | None = None
        if header.get("op") != "abort":
            try:
                writer = await self.tier.begin(step, reserve)
            except AsymstoreError as exc:
                refusal = describe(exc)
        digests: dict[str, tuple[int, str]] = {}
        total = 0
        try:
            while True:
                op, nbytes = header.get("op"), int(header["nbytes"])
                if header.get("step") != step:
                    self._protocol(f"frame of step {header.get('step')} inside version {step}")
                if op == "segment":
                    name = str(header.get("name"))
                    total += nbytes
                    if writer is None or total > reserve or name in digests:
                        refusal = refusal or f"segment {name!r} of {nbytes} bytes does not fit the reservation"
                        await blocking(partial(self._take, header, inline, None))
                    else:
                        buf = self._buffer(nbytes)  # reused: fresh memory costs a page fault per page
                        await blocking(partial(self._take, header, inline, buf))
                        digests[name] = (nbytes, StreamingChecksum([buf]).hexdigest())
                        await writer.write_segment(name, [buf])
                elif op == "manifest":
                    if nbytes > MAX_MANIFEST_BYTES:
                        self._protocol(f"manifest of {nbytes} bytes")
                    body = memoryview(bytearray(nbytes))
                    await blocking(partial(self._take, header, inline, body))
                    if writer is not None and refusal is None:
                        refusal = await self._publish(writer, step, bytes(body), digests)
                    break
                elif op == "abort":
                    refusal = refusal or "the sender aborted the version"
                    break
                else:
                    self._protocol(f"unexpected {op!r} inside version {step}")
                header, inline = await self._header(TAG_REPL)
        except BaseException:
            if writer is not None:
                await asyncio.shield(writer.abort())
            raise
        if refusal is not None:
            if writer is not None:
                await writer.abort()
            if op != "abort":
                self.refused += 1
                self.last_error = refusal
                logger.warning("replica of rank %d step %d refused: %s", self.src, step, refusal)
        else:
            self.received += 1
            await self._retain()
        if op != "abort":
            held = await self.tier.list_versions()
            await blocking(partial(self.link.send, self.src, TAG_ACK, {"step": step, "ok": refusal is None,
                                                                        "reason": refusal, "held": held}))

    async def _probe(self, header: dict[str, Any], inline: bytes | None) -> None:
        """A calibration frame: received into the segment buffer and checksummed, as a segment is; acknowledged."""
        nbytes = int(header["nbytes"])
        if nbytes > MAX_PROBE_BYTES:
            self._protocol(f"a probe of {nbytes} bytes (at most {MAX_PROBE_BYTES})")
        buf = self._buffer(nbytes)
        await blocking(partial(self._take, header, inline, buf))
        StreamingChecksum([buf]).hexdigest()
        await blocking(partial(self.link.send, self.src, TAG_ACK, {"op": "probe", "ok": True}))

    async def _delete(self, step: object) -> None:
        if not isinstance(step, int):
            self._protocol(f"delete of {step!r}")
        try:
            if step in await self.tier.list_versions():
                await self.tier.delete_version(step)
        except (AsymstoreError, OSError) as exc:
            logger.warning("replicas of rank %d: deleting step %d: %s", self.src, step, exc)

    def _buffer(self, nbytes: int) -> memoryview:
        """The receive buffer, grown to ``nbytes`` (at most a reservation: the tier's capacity bounds it)."""
        if len(self._recv) < nbytes:
            self._recv = bytearray(nbytes)
        return memoryview(self._recv)[:nbytes]

    async def _publish(self, writer: VersionWriter, step: int, body: bytes,
                       digests: dict[str, tuple[int, str]]) -> str | None:
        """Check the manifest against what arrived, then publish; the reason it was refused, or None."""
        try:
            manifest = parse_manifest(body)
            if manifest.step != step:
                raise CorruptVersionError(f"manifest names step {manifest.step}")
            by_chunks = [s.name for s in manifest.segments if s.proof != "bytes"]
            if by_chunks:  # checked on arrival, before the manifest said where the chunks are: the bytes proof only
                raise CorruptVersionError(f"segment(s) {by_chunks[:3]} are proved by their chunks (format 5); a "
                                          "replica's segments must be proved by their bytes (the peer tier's own)")
            want = {s.name: (s.size, s.checksum) for s in manifest.segments}
            if want != digests:
                bad = sorted(n for n in set(want) | set(digests) if want.get(n) != digests.get(n))
                raise CorruptVersionError(f"segment(s) {bad} differ from the manifest (size or checksum)")
        except AsymstoreError as exc:
            return f"does not verify: {describe(exc)}"
        await writer.publish(body)
        return None

    async def _segment(self, header: dict[str, Any], lent: contextlib.ExitStack) -> memoryview:
        """The whole segment a request names (of the size it gives, when it gives one).

        Lent by the replica tier without a copy where it can (the view closed with ``lent``), else read.
        """
        step, name, size = int(header["step"]), str(header["name"]), header.get("size")
        size = None if size is None else int(size)
        if isinstance(self.tier, ViewTier):
            return lent.enter_context(self.tier.view_segment(step, name, size))
        return memoryview(await self.tier.read_segment(step, name, size)).cast("B")

    async def _ranges(self, header: dict[str, Any], lent: contextlib.ExitStack) -> list[memoryview]:
        """The byte ranges a ``ranges`` request names, of one segment of exactly the size it gives."""
        if header.get("size") is None:
            raise ValueError("a ranges request without the segment's size")
        ranges = header["ranges"]
        if not isinstance(ranges, list):
            raise ValueError("ranges is not a list")
        data = await self._segment(header, lent)
        out = []
        for pair in ranges:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ValueError(f"range {str(pair)[:50]} is not [offset, length]")
            offset, length = pair
            if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset
                    and 0 <= length <= len(data) - offset):
                raise ValueError(f"range {offset!r}+{length!r} is outside a segment of {len(data)} bytes")
            out.append(data[offset:offset + length])
        return out

    async def _retain(self) -> None:
        steps = await self.tier.list_versions()
        for old in steps[:-self.keep]:
            try:
                await self.tier.delete_version(old)
            except (AsymstoreError, OSError) as exc:
                logger.warning("replicas of rank %d: deleting step %d: %s", self.src, old, exc)

    # -- serving ---------------------------------------------------------

    async def _serve(self) -> None:
        """Answer requests in order; each answer is made ready while the one before it is still being sent.

        At most two answers are under way (one sending, the next waiting for it), whatever the requester
        sends: the loop reads the request after next only once the earlier answer is out.
        """
        sending: concurrent.futures.Future[None] | None = None
        while True:
            header, _ = await self._header(TAG_REQ)
            op = header.get("op")
            if header["nbytes"]:
                self._protocol(f"request {op!r} with a payload")
            if op == "bye":
                if sending is not None:
                    await asyncio.wrap_future(sending)
                return
            rid = header.get("id")
            if rid is not None and not isinstance(rid, int):
                self._protocol(f"request {op!r} with an id that is not an integer: {str(rid)[:50]}")
            lent = contextlib.ExitStack()  # views of replicas being sent: closed once the send is over
            answer: dict[str, Any]
            payload: list[Buffer] = []
            try:
                if op == "list":
                    answer = {"steps": await self.tier.list_versions()}
                elif op == "manifest":
                    body = await self.tier.read_manifest(int(header["step"]))
                    answer, payload = {}, [body]
                elif op == "segment":
                    answer, payload = {}, [await self._segment(header, lent)]
                elif op == "ranges":
                    answer, payload = {}, list(await self._ranges(header, lent))
                else:
                    self._protocol(f"unknown request {op!r}")
                answer["ok"] = True
            except (AsymstoreError, OSError, KeyError, ValueError, TypeError) as exc:
                lent.close()
                answer, payload = {"ok": False, "error": type(exc).__name__, "message": describe(exc)}, []
            if rid is not None:
                answer["id"] = rid
            sent = self._answer(answer, payload, lent, sending)
            if sending is not None:
                await asyncio.wrap_future(sending)
            sending = sent

    def _serving(self, header: dict[str, Any], nbytes: int) -> None:
        """Called before each answer is sent, its views open (a hook for fault-injection tests)."""

    def _answer(self, answer: dict[str, Any], payload: list[Buffer], lent: contextlib.ExitStack,
                after: concurrent.futures.Future[None] | None) -> concurrent.futures.Future[None]:
        """Start sending one answer, once ``after`` (the answer before it) is sent; the send's future.

        The views it is sent from are closed only once its send is over, by its thread through the loop,
        even when the serve loop has stopped waiting (the service stops).
        """
        try:
            self._serving(answer, sum(len(memoryview(p)) for p in payload))
            send = partial(self.link.send, self.src, TAG_RESP, answer, payload)

            def run() -> None:
                if after is not None:  # in the order asked (a failed one ends the serve loop, and the
                    # requester, finding this answer's id where the other's was due, takes the link down)
                    with contextlib.suppress(Exception):
                        after.result()
                send()

            sent = in_thread(run)
        except BaseException:
            lent.close()
            raise
        loop = self._loop

        def close(_: object) -> None:
            if loop.is_closed():
                return  # the service is gone, and its tier with it
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(lent.close)

        sent.add_done_callback(close)
        return sent
