"""asymstore.runtime.daemons: blocking calls on reused daemon threads."""

from __future__ import annotations

import multiprocessing
import threading

from asymstore.runtime.daemons import DaemonWorkers


def test_idle_threads_are_reused_and_a_stuck_one_is_not_waited_for() -> None:
    workers = DaemonWorkers("test-daemons", idle_max=2)
    seen: list[str] = []
    done = threading.Semaphore(0)

    def job() -> None:
        seen.append(threading.current_thread().name + str(threading.get_ident()))
        done.release()

    for _ in range(5):  # one after another: the same thread each time
        workers.submit(job)
        assert done.acquire(timeout=10)
    assert len(set(seen)) == 1
    stuck = threading.Event()
    workers.submit(lambda: (stuck.wait(), None)[1])  # holds its thread; the next job gets another
    workers.submit(job)
    assert done.acquire(timeout=10)
    assert len(set(seen)) == 2
    assert all(t.daemon for t in threading.enumerate() if t.name == "test-daemons")
    stuck.set()


def test_at_most_idle_max_threads_wait() -> None:
    workers = DaemonWorkers("test-daemons-max", idle_max=1)
    gate = threading.Event()
    finished = threading.Semaphore(0)

    def job() -> None:
        gate.wait(10)
        finished.release()

    for _ in range(3):  # three at once: three threads
        workers.submit(job)
    gate.set()
    for _ in range(3):
        assert finished.acquire(timeout=10)
    for _ in range(100):  # the two beyond idle_max end instead of waiting
        if sum(t.name == "test-daemons-max" for t in threading.enumerate()) == 1:
            break
        threading.Event().wait(0.05)
    assert workers.idle == 1
    assert sum(t.name == "test-daemons-max" for t in threading.enumerate()) == 1


def test_a_forked_child_starts_its_own_threads() -> None:
    workers = DaemonWorkers("test-daemons-fork")
    done = threading.Event()
    workers.submit(done.set)
    assert done.wait(10)
    for _ in range(100):
        if workers.idle:
            break
        threading.Event().wait(0.05)
    assert workers.idle == 1  # a parent's thread waits: it does not exist in a forked child

    def child(conn: object) -> None:
        ran = threading.Event()
        workers.submit(ran.set)
        conn.send(ran.wait(10))  # type: ignore[attr-defined]

    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=child, args=(child_end,))
    proc.start()
    try:
        assert parent_end.poll(30) and parent_end.recv() is True
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
