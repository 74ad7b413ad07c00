"""The same-host pool's pinning (``connector/media/hostpool.py``): the pieces a load asks
for are pinned first, a load never waits for pinning, and a failed registration leaves
nothing pinned.  Pure bookkeeping: registration is a recorded callable here; the real
``cudaHostRegister`` runs in ``tests/integration/test_gpu_path.py`` on a GPU."""

from __future__ import annotations

import threading

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


def test_every_piece_is_pinned_wanted_ones_first() -> None:
    p, order, _ = _pinner(8)
    assert not p.pinned([5 * MIB])
    p.want([5 * MIB + 10, 6 * MIB, 5 * MIB])
    p.run()
    assert order[:2] == [5, 6] and sorted(order) == list(range(8))
    assert p.complete and p.done.is_set() and p.pinned([0, 7 * MIB + 1])


def test_a_load_never_waits_for_pinning() -> None:
    """While a registration is stuck in the driver, asking whether blocks are pinned
    (what every load does) answers at once: their copies go the pageable way."""
    gate, entered = threading.Event(), threading.Event()
    p, order, _ = _pinner(4, gate, entered=entered)
    t = threading.Thread(target=p.run)
    t.start()
    try:
        assert entered.wait(5)
        answered = threading.Event()

        def load() -> None:
            assert not p.pinned([2 * MIB])
            p.want([2 * MIB])
            answered.set()

        threading.Thread(target=load).start()
        assert answered.wait(5), "a load waited for the pool's pinning"
    finally:
        gate.set()
        t.join(10)
    assert order[:2] == [0, 2]  # the piece being pinned, then the one the load wanted
    assert p.pinned([2 * MIB])


def test_a_failed_registration_unpins_everything() -> None:
    p, _, unpinned = _pinner(4, fail_at=2)
    p.run()
    assert p.failed and p.done.is_set() and not p.complete
    assert sorted(unpinned) == [0, 1 * MIB]
    assert not p.pinned([0]) and not p.pinned([1 * MIB])


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
