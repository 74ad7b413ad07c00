"""Unit tests of the in-memory block index and InProcessSink (pure logic, no I/O)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pegaflow.coordinator.index import MAX_SHARDS, BlockIndex
from pegaflow.coordinator.inprocess_sink import InProcessSink

from pegaflow.errors import BadRequest
from pegaflow.keys import BlockLocation, NodeRecord


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def node(node_id: str, host: str = "h1", cap: int = 1 << 30, used: int = 0) -> NodeRecord:
    return NodeRecord(node_id=node_id, host=host, ucx_port=1, capacity_bytes=cap, used_bytes=used)


def make(*node_ids: str) -> BlockIndex:
    idx = BlockIndex()
    for n in node_ids:
        idx.set_node(node(n))
    return idx


def test_lookup_longest_prefix_single_shard() -> None:
    idx = make("a", "b")
    for i in range(5):
        idx.add("ns", h(i), 0, "a" if i < 3 else "b")
    idx.remove("ns", h(3), 0)
    r = idx.lookup("ns", [h(i) for i in range(5)], [0])
    assert r.hits == 3
    assert [list(b) for b in r.blocks] == [["a"], ["a"], ["a"]]
    assert r.nodes == {"a"}
    assert idx.lookup("ns", [h(4)], [0]).hits == 1
    assert idx.lookup("other", [h(0)], [0]).hits == 0
    assert idx.lookup("ns", [], [0]).hits == 0
    assert idx.lookup("ns", [h(99), h(0)], [0]).hits == 0


def test_lookup_needs_every_requested_shard() -> None:
    idx = make("a", "b")
    for i in range(4):
        idx.add("ns", h(i), 0, "a")
    for i in range(2):
        idx.add("ns", h(i), 1, "b")
    hashes = [h(i) for i in range(4)]
    r = idx.lookup("ns", hashes, [0, 1])
    assert r.hits == 2
    assert [list(b) for b in r.blocks] == [["a", "b"], ["a", "b"]]
    assert idx.lookup("ns", hashes, [0]).hits == 4
    assert idx.lookup("ns", hashes, [1]).hits == 2
    assert [list(b) for b in idx.lookup("ns", hashes, [1, 0]).blocks] == [["b", "a"]] * 2
    assert idx.lookup("ns", hashes, [2]).hits == 0
    assert idx.lookup("ns", hashes, [0, 2]).hits == 0


def test_sparse_shards() -> None:
    idx = make("a")
    idx.add("ns", h(1), 5, "a")
    assert idx.lookup("ns", [h(1)], [5]).hits == 1
    assert idx.lookup("ns", [h(1)], [0]).hits == 0
    assert idx.lookup("ns", [h(1)], [4, 5]).hits == 0
    assert idx.get("ns", h(1)) == {5: "a"}
    assert idx.num_entries == 1
    with pytest.raises(BadRequest):
        idx.add("ns", h(1), MAX_SHARDS, "a")


def test_entries_of_unknown_nodes_are_not_hits_until_the_node_is_known() -> None:
    idx = make("a")
    idx.add("ns", h(0), 0, "a")
    idx.add("ns", h(1), 0, "ghost")
    assert idx.lookup("ns", [h(0), h(1)], [0]).hits == 1
    idx.set_node(node("ghost"))
    assert idx.lookup("ns", [h(0), h(1)], [0]).hits == 2
    idx.remove_node("ghost", purge=False)
    assert idx.lookup("ns", [h(0), h(1)], [0]).hits == 1
    assert idx.entries_of("ghost") == 1


def test_remove_only_by_holder() -> None:
    idx = make("a", "b")
    idx.add("ns", h(0), 0, "a")
    idx.add("ns", h(0), 0, "b")  # b overwrote a's entry
    assert idx.entries_of("a") == 0 and idx.entries_of("b") == 1
    assert not idx.remove("ns", h(0), 0, "a")
    assert idx.lookup("ns", [h(0)], [0]).blocks[0][0] == "b"
    assert idx.remove("ns", h(0), 0, "b")
    assert idx.num_blocks == 0 and idx.num_namespaces == 0
    assert not idx.remove("ns", h(0), 0)


def test_remove_node_purges_its_entries_and_keeps_others() -> None:
    idx = make("a", "b")
    for i in range(100):
        idx.add("ns", h(i), 0, "a")
        idx.add("ns", h(i), 1, "b" if i % 2 else "a")
        idx.add("ns2", h(i), 0, "b")
    assert idx.num_blocks == 200
    assert idx.num_entries == 300
    dropped = idx.remove_node("a")
    assert dropped == 150
    assert idx.node("a") is None
    assert idx.entries_of("a") == 0
    assert idx.num_entries == 150
    assert idx.num_blocks == 150  # ns: the 50 blocks with shard 1 on b; ns2: all 100
    assert idx.lookup("ns", [h(1)], [1]).hits == 1
    assert idx.lookup("ns", [h(1)], [0]).hits == 0
    assert idx.lookup("ns2", [h(i) for i in range(100)], [0]).hits == 100
    idx.remove_node("b")
    assert idx.num_blocks == idx.num_entries == idx.num_namespaces == 0


def test_counts_and_node_table() -> None:
    idx = make("a")
    idx.add("x", h(0), 0, "a")
    idx.add("x", h(0), 1, "a")
    idx.add("y", h(0), 0, "a")
    idx.add("y", h(0), 0, "a")  # idempotent
    assert (idx.num_blocks, idx.num_entries, idx.num_namespaces) == (2, 3, 2)
    assert idx.node_counts() == {"a": 3}
    assert sorted(idx.namespaces()) == ["x", "y"]
    assert idx.node_wire("a") == node("a").to_wire()
    idx.set_node(node("a", used=5))
    assert idx.node("a") is not None and idx.node("a").used_bytes == 5  # type: ignore[union-attr]
    assert idx.node_wire("a")["used_bytes"] == 5  # type: ignore[index]


def test_replace_with_and_clear() -> None:
    idx = make("a")
    idx.add("ns", h(0), 0, "a")
    fresh = make("b")
    fresh.add("ns", h(1), 0, "b")
    idx.replace_with(fresh)
    assert idx.lookup("ns", [h(1)], [0]).hits == 1
    assert idx.lookup("ns", [h(0)], [0]).hits == 0
    assert fresh.num_blocks == 0
    idx.clear()
    assert idx.num_blocks == 0 and idx.nodes() == []


def test_rows_are_shared_between_blocks() -> None:
    idx = make("a")
    for i in range(1000):
        for s in range(4):
            idx.add("ns", h(i), s, "a")
    assert idx.num_rows == 1  # one placement ("a" on every shard), stored once
    for i in range(1000):
        idx.remove("ns", h(i), 3)
    assert idx.num_rows == 1  # the 4-shard row was freed, the 3-shard one took over


async def test_local_sink_feeds_the_index() -> None:
    idx = BlockIndex()
    sink = InProcessSink(idx)
    await sink.start(node("n1"))
    loc = BlockLocation(node="n1", slot=3, gen=1, size=4096, xxh3=7)
    sink.publish("ns", h(0), 0, loc)
    sink.publish("ns", h(1), 0, loc)
    await sink.flush()
    assert idx.lookup("ns", [h(0), h(1)], [0]).hits == 2
    sink.unpublish("ns", h(1), 0, loc)
    sink.unpublish("ns", h(0), 0, BlockLocation("other", 0, 0, 0, 0))  # not its holder
    assert idx.lookup("ns", [h(0), h(1)], [0]).hits == 1
    await sink.update_node(node("n1", used=10))
    assert idx.node("n1").used_bytes == 10  # type: ignore[union-attr]
    await sink.close()
    assert idx.num_blocks == 0 and idx.nodes() == []


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "remove_by", "drop_node", "set_node"]),
        st.sampled_from(["ns1", "ns2"]),
        st.integers(0, 7),  # hash
        st.integers(0, 3),  # shard
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from([0, 1, 7, (1 << 57) + 3, (1 << 64) - 1]),  # generation
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True))
def test_matches_a_reference_model(
    program: list[tuple[str, str, int, int, str, int]], shards: list[int]
) -> None:
    idx = make("a", "b", "c")
    model: dict[tuple[str, int, int], str] = {}
    gens: dict[tuple[str, int, int], int] = {}
    alive = {"a", "b", "c"}
    for op, ns, hi, shard, n, gen in program:
        if op == "add":
            idx.add(ns, h(hi), shard, n, gen)
            model[(ns, hi, shard)] = n
            gens[(ns, hi, shard)] = gen
        elif op == "remove":
            idx.remove(ns, h(hi), shard)
            model.pop((ns, hi, shard), None)
        elif op == "remove_by":
            idx.remove(ns, h(hi), shard, n)
            if model.get((ns, hi, shard)) == n:
                del model[(ns, hi, shard)]
        elif op == "drop_node":
            idx.remove_node(n)
            alive.discard(n)
            model = {k: v for k, v in model.items() if v != n}
        else:
            idx.set_node(node(n))
            alive.add(n)
    assert idx.num_entries == len(model)
    assert idx.num_blocks == len({(ns, hi) for ns, hi, _ in model})
    for n in ("a", "b", "c"):
        assert idx.entries_of(n) == sum(1 for v in model.values() if v == n)
    for ns in ("ns1", "ns2"):
        hashes = [h(i) for i in range(8)]
        expect_hits = 0
        expect_blocks = []
        expect_gens = []
        for i in range(8):
            row = [model.get((ns, i, s)) for s in shards]
            if any(v is None or v not in alive for v in row):
                break
            expect_hits += 1
            expect_blocks.append(row)
            expect_gens += [gens[(ns, i, s)] for s in shards]
        r = idx.lookup(ns, hashes, shards)
        assert r.hits == expect_hits
        assert [list(b) for b in r.blocks] == expect_blocks
        assert r.nodes == {n for row in expect_blocks for n in row}
        assert r.gens is None
        rg = idx.lookup(ns, hashes, shards, gens=True)
        assert (rg.hits, rg.blocks, rg.gens) == (r.hits, r.blocks, expect_gens)
        for i in range(8):
            assert idx.locations(ns, h(i)) == {
                s: (v, gens[(ns2, i2, s)])
                for (ns2, i2, s), v in model.items()
                if (ns2, i2) == (ns, i)
            }


def test_entries_and_generations_of_blocks() -> None:
    idx = make("a", "b")
    big = (1 << 64) - 1
    idx.add("ns", h(0), 0, "a", 5)
    idx.add("ns", h(1), 0, "a", 6)
    idx.add("ns", h(1), 2, "b", big)
    assert sorted(idx.hashes("ns")) == [h(0), h(1)] and idx.hashes("nope") == []
    assert sorted(idx.entries("ns", [h(1), h(0), h(9)])) == [
        (h(0), 0, "a", 5),
        (h(1), 0, "a", 6),
        (h(1), 2, "b", big),
    ]
    assert idx.locations("ns", h(1)) == {0: ("a", 6), 2: ("b", big)}
    r = idx.lookup("ns", [h(1), h(0)], [0], gens=True)
    assert (r.hits, r.gens) == (2, [6, 5])  # mixed value lengths in one namespace
    assert idx.lookup("ns", [h(1)], [2, 0], gens=True).gens == [big, 6]
    idx.add("ns", h(0), 0, "a", 7)  # the same holder stores it again: a new generation
    assert idx.locations("ns", h(0)) == {0: ("a", 7)} and idx.entries_of("a") == 2
    with pytest.raises(BadRequest):
        idx.add("ns", h(2), 0, "a", 1 << 64)
    assert idx.remove_node("b") == 1
    assert idx.lookup("ns", [h(1), h(0)], [0], gens=True).gens == [6, 7]


def test_long_lookups_unpack_in_chunks() -> None:
    idx = make("a", "b")
    n = 3000  # more than one struct chunk, not a power of two
    for i in range(n):
        idx.add("ns", h(i), 0, "a" if i % 7 else "b", i)
    r = idx.lookup("ns", [h(i) for i in range(n)], [0], gens=True)
    assert r.hits == n and r.gens == list(range(n))
    assert [b[0] for b in r.blocks] == ["a" if i % 7 else "b" for i in range(n)]
    for i in range(n):
        idx.add("ns", h(i), 1, "b", 10 * i)
    r = idx.lookup("ns", [h(i) for i in range(n)], [1, 0], gens=True)
    assert r.hits == n and r.gens[:4] == [0, 0, 10, 1] and r.gens[-2:] == [10 * (n - 1), n - 1]
