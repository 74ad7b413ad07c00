"""The hybrid storage rule (:mod:`pegaflow.connector.scheduler.hybrid`), pure logic."""

from __future__ import annotations

from pegaflow.connector.scheduler.hybrid import GroupLayout

# a full-attention group, a 64-token window (4 blocks of 16), a 20-token one (2 blocks)
LAY = GroupLayout.of([0, 64, 20], 16, anchor_tokens=128)  # anchors every 8 positions


def test_windows_follow_vllms_rule() -> None:
    assert LAY.windows == (0, 4, 2) and LAY.anchor == 8
    assert LAY.full == [0] and LAY.windowed == [1, 2]
    assert GroupLayout.of([0, 16], 16, 0).windows == (0, 1)  # cdiv(15, 16)
    assert GroupLayout.of([0, 17], 16, 0).windows == (0, 1)
    assert GroupLayout.of([0, 18], 16, 0).windows == (0, 2)


def test_a_hit_needs_every_full_block_and_each_window_before_its_end() -> None:
    assert LAY.full_slots(2, 5) == [(2, 0), (3, 0), (4, 0)]
    assert LAY.window_slots(0, 10) == [(6, 1), (7, 1), (8, 1), (8, 2), (9, 1), (9, 2)]
    # positions before start are vLLM's own
    assert LAY.window_slots(8, 10) == [(8, 1), (8, 2), (9, 1), (9, 2)]
    assert LAY.ends(0, 20) == [20, 16]
    assert LAY.ends(0, 16) == [16, 8]
    assert LAY.ends(9, 12) == [12]  # no anchor after the start
    assert LAY.ends(5, 5) == []


def test_a_request_stores_its_windows_not_its_length() -> None:
    saved = LAY.save_slots(0, 20)  # one step computing 20 positions
    assert [p for p, g in saved if g == 0] == list(range(20))
    # windows before the anchors 8 and 16 and before the end 20
    assert [p for p, g in saved if g == 1] == [4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19]
    assert [p for p, g in saved if g == 2] == [6, 7, 14, 15, 18, 19]
    # a long prompt: what a window group stores grows with its anchors only
    no_anchor = GroupLayout.of([0, 64], 16, 0)
    assert len([s for s in no_anchor.save_slots(0, 10_000) if s[1] == 1]) == 4
    # a later step stores its own new positions' windows
    assert [p for p, g in LAY.save_slots(20, 22) if g == 1] == [20, 21]


def test_a_state_group_is_a_window_of_one_block_stored_where_vllm_names_it() -> None:
    """A Mamba / linear-attention group: a hit ending at ``L`` needs its block of
    ``L - 1`` (the state after it); its blocks are never stored by the window rule (vLLM
    names where it kept a state), and a lookup tries the ends just before a full run's
    end too, as vLLM keeps states only where its steps ended."""
    lay = GroupLayout.of([0, 0, 0], 16, anchor_tokens=128, states=[True, False, True])
    assert lay.windows == (1, 0, 1) and lay.windowed == [0, 2]
    assert lay.is_state(0) and not lay.is_state(1)
    assert lay.window_slots(0, 10) == [(9, 0), (9, 2)]
    assert lay.save_slots(0, 10) == [(p, 1) for p in range(10)]
    assert lay.ends(0, 10) == [10, 9, 8, 7]  # then no anchor: 8 is one already
    assert lay.ends(0, 20) == [20, 19, 18, 17, 16]
    assert lay.ends(8, 10) == [10, 9]
    assert not LAY.is_state(1)
