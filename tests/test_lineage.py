"""Where a zygote pool's processes come from (``fastload.launching.fork_server``),
with no process: the fork servers and zygotes are fakes
(``support.fake_zygotes``) that record what they are asked.

One fork server per accelerator setting, started by the first lease,
running after the last is released until stopped, replaced when gone, and
forgotten (its socket closed) in a forked child; each pool's zygote forked
from it; workers that inherit the session their zygote preloaded, and only
that one; a zygote that could not preload replaced when it is left unsafe,
and no more preloads tried; a pool's teardown stops its zygotes and lets go
of its lease, the server running on.
"""

from __future__ import annotations

import logging
import os

import pytest

from fastload.pool import teardown
from fastload.launching.parcels import Parcel
from fastload.launching.fork_server import Lineage
from fastload.launching.zygote_protocol import DECLINED, LOST, TAINTED
from fastload.pool.handles import WorkerHandles
from support.fake_zygotes import fake_servers
from support.ring_driver import new_ring

HIDE = True  # the default: workers see no accelerator


def test_every_pool_s_zygote_is_forked_from_one_fork_server_per_setting() -> None:
    servers, started = fake_servers()
    a, b = Lineage(2, HIDE, servers=servers), Lineage(2, HIDE, servers=servers)
    assert len(started) == 1
    server = started[0]
    assert a.current.server is server and b.current.server is server
    assert a.current is not b.current and server.forked == [a.current, b.current]
    gpu = Lineage(2, False, servers=servers)  # allow_gpu_in_workers: a server of its own
    assert len(started) == 2 and not started[1].hide_accelerators
    assert gpu.current.server is started[1]


def test_a_zygote_forked_ahead_for_the_loader_is_the_pool_s_first() -> None:
    servers, started = fake_servers()
    spare = servers.server(HIDE).fork_zygote(wait=False)
    lineage = Lineage(2, HIDE, spare, servers=servers)
    assert lineage.zygotes == [spare]
    assert started[0].forked == [spare]  # none forked besides


def test_the_fork_server_outlives_its_leases_until_stopped() -> None:
    servers, started = fake_servers()
    first, second = servers.lease(HIDE), servers.lease(HIDE)
    server = started[0]
    assert servers.users(HIDE) == 2
    first.release()
    first.release()  # idempotent: one lease, released once
    assert servers.users(HIDE) == 1 and second.held and not first.held
    second.release()
    assert not server.stopped and servers.users(HIDE) == 0  # the last loader is gone
    assert servers.lease(HIDE) and len(started) == 1  # the next loader finds it running
    assert servers.held() == ([server.launched_pid], [])
    servers.stop_all()  # fastload.shutdown(), or at exit
    assert server.stopped and servers.held() == ([], [])
    servers.lease(HIDE)
    assert len(started) == 2 and not started[1].stopped  # a new lease starts a new one


def test_a_forked_child_closes_its_copy_of_the_server_s_socket_and_forgets_it(monkeypatch) -> None:
    servers, started = fake_servers()
    servers.lease(HIDE)
    servers.after_fork_in_child()  # in the owner itself: nothing to do
    assert not started[0].closed_inherited
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as in a forked child
    servers.after_fork_in_child()
    assert started[0].closed_inherited and not started[0].stopped  # the owner's to stop
    assert servers.users(HIDE) == 0 and servers.held() == ([], [])
    servers.server(HIDE)
    assert len(started) == 2  # the child's own, if it needs one


def test_a_fork_server_that_is_gone_is_replaced() -> None:
    servers, started = fake_servers()
    servers.lease(HIDE)
    started[0].die()
    assert servers.server(HIDE) is started[1]
    assert started[0].stopped  # what is left of it is cleaned up


def test_a_zygote_is_forked_again_from_a_new_server_if_the_server_dies_forking_it() -> None:
    servers, started = fake_servers()
    servers.lease(HIDE)
    started[0].fork_fails = 1
    lineage = Lineage(2, HIDE, servers=servers)
    assert len(started) == 2 and lineage.current.server is started[1]


def test_workers_inherit_the_session_their_zygote_preloaded_and_no_other() -> None:
    servers, _ = fake_servers()
    lineage = Lineage(3, HIDE, servers=servers)
    zygote = lineage.current
    lineage.preload(Parcel(b"epoch 1"), timeout=None)
    assert zygote.preloads == [1] and lineage.preloaded == 1
    child = lineage.fork(0, "fastload.worker.loop:worker_main", Parcel(b"spec"))
    assert child.zygote is zygote and child.target == "fastload.worker.loop:worker_main"
    assert lineage.inherits(0) and not lineage.inherits(1)  # worker 1 was not forked
    lineage.preload(Parcel(b"epoch 2"), timeout=None)
    assert lineage.preloaded == 2 and not lineage.inherits(0)  # it holds epoch 1's
    lineage.fork(0, "t", Parcel(b"spec"))
    assert lineage.inherits(0)
    lineage.forget()  # the workers are retired: the zygote lets go of the session
    assert zygote.forgotten == 1 and lineage.preloaded is None and not lineage.inherits(0)


def test_a_declined_session_is_unpickled_by_each_worker_from_then_on() -> None:
    servers, _ = fake_servers()
    lineage = Lineage(2, HIDE, servers=servers)
    zygote = lineage.current
    zygote.preload_answer = (DECLINED, "unpickling it opens a file")
    lineage.preload(Parcel(b"epoch 1"), timeout=None)
    lineage.fork(0, "t", Parcel(b"spec"))
    assert lineage.preloaded is None and not lineage.inherits(0)
    assert lineage.zygotes == [zygote] and not zygote.stopped  # still safe to fork from
    lineage.preload(Parcel(b"epoch 2"), timeout=None)
    assert zygote.preloads == [1]  # the dataset is the same: not tried again


@pytest.mark.parametrize("outcome", [TAINTED, LOST])
def test_a_zygote_left_unsafe_by_a_session_is_replaced(outcome: int,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    servers, started = fake_servers()
    lineage = Lineage(2, HIDE, servers=servers)
    old = lineage.current
    old.preload_answer = (outcome, "unpickling it started a thread")
    with caplog.at_level(logging.WARNING, logger="fastload"):
        lineage.preload(Parcel(b"epoch 1"), timeout=5.0)
    assert old.stopped and lineage.zygotes == [old, lineage.current]
    assert lineage.current.server is started[0]
    assert "workers unpickle the dataset themselves" in caplog.text
    assert "unpickling it started a thread" in caplog.text
    lineage.preload(Parcel(b"epoch 2"), timeout=5.0)
    assert lineage.current.preloads == [] and lineage.preloaded is None


def test_a_zygote_that_died_is_replaced_before_the_next_fork() -> None:
    servers, started = fake_servers()
    lineage = Lineage(2, HIDE, servers=servers)
    old = lineage.current
    old.die()
    child = lineage.fork(1, "t", Parcel(b"spec"))
    assert len(lineage.zygotes) == 2 and child.zygote is lineage.current is not old
    assert lineage.current.server is started[0]


def test_what_a_preload_imported_is_imported_by_the_server_too() -> None:
    servers, started = fake_servers()
    lineage = Lineage(2, HIDE, servers=servers)
    lineage.current.imports_on_preload = ["json", "support.datasets"]
    lineage.preload(Parcel(b"epoch 1"), timeout=None)
    assert started[0].warmed == [["json", "support.datasets"]]
    declined = Lineage(2, HIDE, servers=servers)
    declined.current.imports_on_preload = ["csv"]
    declined.current.preload_answer = (DECLINED, "it holds a lock")
    declined.preload(Parcel(b"epoch 1"), timeout=None)
    assert started[0].warmed == [["json", "support.datasets"]]  # not after a refusal


def test_a_pool_s_teardown_stops_its_zygotes_and_lets_go_of_its_lease() -> None:
    servers, started = fake_servers()
    loader_lease = servers.lease(HIDE)  # a loader still alive
    lineage = Lineage(2, HIDE, servers=servers)
    lineage.current.die()
    lineage.fork(0, "t", Parcel(b"spec"))  # a replacement zygote
    ring = new_ring()
    teardown.stop_pool(ring, WorkerHandles(ring, True), lineage.zygotes, os.getpid(),
                       leases=[lineage.lease])
    assert all(z.stopped for z in lineage.zygotes) and len(lineage.zygotes) == 2
    assert not lineage.lease.held and servers.users(HIDE) == 1  # the loader's lease
    loader_lease.release()
    assert not started[0].stopped  # the server outlives its last user
