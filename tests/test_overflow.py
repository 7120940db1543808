"""The owner of overflow segments on its own: workers' channels are
socketpairs, segments memfds sent on them by the test, no worker process;
every fd is counted in ``/proc/self/fd``."""

from __future__ import annotations

import os
import socket
from typing import Iterator, List

import pytest

from fastload.transport import overflow
from support.processes import open_fds
from support.ring_driver import Channels, segment


@pytest.fixture
def ch() -> Iterator[Channels]:
    c = Channels(2)
    yield c
    c.close()


def _read(ch: Channels, worker: int, seq: int) -> bytes:
    m = ch.segments.open(worker, seq)
    try:
        return bytes(m[:])
    finally:
        m.close()


def test_each_batch_gets_its_own_segment_and_those_met_on_the_way_are_kept(ch: Channels) -> None:
    before = open_fds()
    for seq in (5, 7, 9):
        ch.send(0, seq, f"batch {seq}".encode())
    assert _read(ch, 0, 7) == b"batch 7"  # 5 was met on the way: kept
    assert len(ch.segments) == 1 and len(open_fds() - before) == 1
    assert _read(ch, 0, 5) == b"batch 5"  # received early
    assert _read(ch, 0, 9) == b"batch 9"  # still on the channel
    assert not len(ch.segments) and open_fds() <= before


def test_a_mapping_outlives_the_fd(ch: Channels) -> None:
    ch.send(1, 3, b"x" * 10000)
    before = open_fds()
    m = ch.segments.open(1, 3)
    try:
        assert len(m) == 10000 and m[9999:] == b"x"
    finally:
        m.close()
    assert open_fds() <= before


def test_discarding_a_batch_closes_its_segment(ch: Channels) -> None:
    before = open_fds()
    ch.send(0, 1, b"one")
    ch.send(0, 2, b"two")
    ch.segments.discard(0, 2)  # read from the channel; 1 kept on the way
    assert len(ch.segments) == 1 and len(open_fds() - before) == 1
    ch.segments.discard(0, 1)  # received early
    assert not len(ch.segments) and open_fds() <= before


def test_a_replaced_worker_s_unread_segments_are_collected(ch: Channels) -> None:
    ch.send(1, 10, b"ten")
    ch.send(1, 11, b"eleven")
    ch.theirs[1].close()  # the worker died
    before = open_fds()
    ch.segments.collect(1)
    assert len(ch.segments) == 2 and len(open_fds() - before) == 2
    # The pool replaces the channel in place; what the old one held stays readable.
    ch.mine[1].close()
    ch.mine[1], ch.theirs[1] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    assert _read(ch, 1, 10) == b"ten"
    ch.segments.forget(11)  # a batch it never committed: made again, segment nobody's
    ch.segments.forget(12)  # one it never sent: nothing to close
    assert not len(ch.segments)


def test_collecting_an_empty_channel_returns_at_once_and_leaves_it_blocking(ch: Channels) -> None:
    ch.segments.collect(0)
    assert not len(ch.segments) and ch.mine[0].getblocking()
    ch.send(0, 4, b"four")
    ch.segments.collect(0)
    assert len(ch.segments) == 1 and ch.mine[0].getblocking()


def test_a_channel_closed_before_the_segment_came_is_an_error(ch: Channels) -> None:
    ch.send(0, 1, b"one")
    ch.theirs[0].close()
    with pytest.raises(RuntimeError, match="worker 0 closed its channel before sending the "
                                           "overflow data of batch 2"):
        ch.segments.open(0, 2)
    assert len(ch.segments) == 1  # what it met on the way is kept


def test_closing_closes_every_segment_held(ch: Channels) -> None:
    before = open_fds()
    for w in (0, 1):
        for seq in range(3):
            ch.send(w, 10 * w + seq, b"s")
        ch.segments.collect(w)
    assert len(ch.segments) == 6 and len(open_fds() - before) == 6
    ch.segments.close()
    ch.segments.close()  # idempotent, as the pool's teardown is
    assert not len(ch.segments) and open_fds() <= before


def test_the_channels_are_the_pool_s_list_read_at_each_call(ch: Channels) -> None:
    extra: List[socket.socket] = list(socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
    try:
        ch.mine.append(extra[0])  # a worker added (num_workers="auto")
        fd = segment(b"new")
        try:
            overflow.send(extra[1], 99, fd)
        finally:
            os.close(fd)
        assert _read(ch, 2, 99) == b"new"
    finally:
        ch.mine.remove(extra[0])
        for s in extra:
            s.close()
