"""The same-host pool's pinning (``connector/media/hostpool.py``): a load pins the pieces
it needs itself, never waits for another piece's registration, no piece is registered
twice, and a failed registration leaves nothing pinned.  Pure bookkeeping: registration
is a recorded callable here; the real ``cudaHostRegister`` runs in
``tests/integration/test_gpu_path.py`` on a GPU."""

from __future__ import annotations

import threading

import pytest
from pegaflow.connector.media import hostpool
from pegaflow.connector.media.hostpool import PIN_PIECE, PoolPinner, pin_piece

MIB = 1 << 20


def _pinner(
    pieces: int,
    gate: threading.Event | None = None,
    fail_at: int = -1,
    entered: threading.Event | None = None,
) -> tuple[PoolPinner, list[int], list[int]]:
    order: list[int] = []
    unpinned: list[int] = []

    def register(off: int, n: int) -> int:
        if entered is not None:
            entered.set()
        if gate is not None:
            assert gate.wait(10)
        order.append(off // MIB)
        return 1 if off // MIB == fail_at else 0

    return PoolPinner(pieces * MIB, MIB, register, unpinned.append), order, unpinned


def test_piece_is_a_multiple_of_the_slab_and_old_nodes_keep_1_gib() -> None:
    assert pin_piece(64 * MIB) == PIN_PIECE
    assert pin_piece(48 * MIB) % (48 * MIB) == 0 and pin_piece(48 * MIB) >= PIN_PIECE
    assert pin_piece(256 * MIB) == 256 * MIB
    assert pin_piece(0) == 1 << 30


def test_a_load_pins_the_pieces_it_needs_itself() -> None:
    p, order, _ = _pinner(8)
    assert p.pin_now([5 * MIB + 10, 6 * MIB, 5 * MIB])
    assert order == [5, 6] and p.pinned([5 * MIB, 6 * MIB]) and not p.pinned([0])
    assert p.pin_now([6 * MIB + 1]) and order == [5, 6]  # pinned already: nothing to do
    p.run()
    assert sorted(order) == list(range(8))  # the thread pins the rest, each piece once
    assert p.complete and p.done.is_set() and p.pinned([0, 7 * MIB + 1])


def test_a_load_waits_for_no_registration_but_of_its_own_pieces() -> None:
    """While the pinning thread's registration of piece 0 is stuck in the driver, a
    load whose blocks lie in piece 3 pins it and goes on; one whose blocks lie in piece
    0 too waits for that registration (and does not repeat it)."""
    gate, entered = threading.Event(), threading.Event()
    order: list[int] = []

    def register(off: int, n: int) -> int:
        if off == 0:
            entered.set()
            assert gate.wait(10)
        order.append(off // MIB)
        return 0

    p = PoolPinner(4 * MIB, MIB, register, lambda off: None)
    t = threading.Thread(target=p.run)
    t.start()
    other, same = threading.Event(), threading.Event()
    try:
        assert entered.wait(5)
        loads = [
            threading.Thread(target=lambda: p.pin_now([3 * MIB]) and other.set()),
            threading.Thread(target=lambda: p.pin_now([0, 3 * MIB]) and same.set()),
        ]
        for load in loads:
            load.start()
        assert other.wait(5), "a load waited for another piece's registration"
        assert not same.wait(0.2) and order == [3]
    finally:
        gate.set()
        t.join(10)
    for load in loads:
        load.join(10)
    assert same.is_set() and sorted(order) == [0, 1, 2, 3]  # every piece once
    assert p.complete


def test_a_load_does_not_wait_long_for_a_stuck_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A registration stuck in the driver holds a load needing its piece for
    ``PIECE_WAIT_S`` at most: then that load copies the pageable way."""
    monkeypatch.setattr(hostpool, "PIECE_WAIT_S", 0.05)
    gate, entered = threading.Event(), threading.Event()
    p, _, _ = _pinner(2, gate, entered=entered)
    t = threading.Thread(target=p.run)
    t.start()
    try:
        assert entered.wait(5)
        assert not p.pin_now([0])
    finally:
        gate.set()
        t.join(10)
    assert p.pin_now([0]) and p.complete


def test_a_failed_registration_unpins_everything() -> None:
    p, _, unpinned = _pinner(4, fail_at=2)
    p.run()
    assert p.failed and p.done.is_set() and not p.complete
    assert sorted(unpinned) == [0, 1 * MIB]
    assert not p.pinned([0]) and not p.pinned([1 * MIB])
    assert not p.pin_now([3 * MIB])  # loads copy the pageable way from then on


def test_a_load_whose_piece_fails_to_pin_copies_the_pageable_way() -> None:
    p, _, unpinned = _pinner(4, fail_at=2)
    assert p.pin_now([1 * MIB])
    assert not p.pin_now([2 * MIB]) and p.failed
    p.run()  # the thread stops at once and unpins what was pinned
    assert unpinned == [1 * MIB] and not p.pinned([1 * MIB])


def test_stop_ends_pinning_and_release_unpins() -> None:
    gate = threading.Event()
    p, order, unpinned = _pinner(16, gate)
    t = threading.Thread(target=p.run)
    t.start()
    p.stop()
    gate.set()
    t.join(10)
    assert not t.is_alive() and len(order) < 16
    p.release()
    assert len(unpinned) == len(order) and not p.pinned([0])


def test_no_piece_is_pinned_while_a_copy_is_being_queued() -> None:
    """A registration holds the driver's lock every copy call needs: while a load queues
    its copies (``hold_off``), the pinner waits (up to its bound) and goes on after."""
    started = threading.Event()
    p, order, _ = _pinner(2, entered=started)
    p.hold_off_s = 30.0
    with p.hold_off():
        t = threading.Thread(target=p.run)
        t.start()
        assert not started.wait(0.3)  # nothing registered while the copies are queued
    t.join(10)
    assert order == [0, 1] and p.complete


def test_pinning_goes_on_under_steady_copies() -> None:
    """Copies queued back to back hold each piece off for ``hold_off_s`` at most."""
    p, order, _ = _pinner(3)
    p.hold_off_s = 0.01
    with p.hold_off():
        p.run()
    assert order == [0, 1, 2] and p.complete
