"""The ancestor-aware LRU that keeps hot cached snapshots in memory."""

from __future__ import annotations

from bunshin_gym.rollout.prefix_cache import Node
from bunshin_gym.rollout.residency import Residency


def chain(*names: str) -> list[Node]:
    nodes, parent = [], None
    for i, name in enumerate(names):
        n = Node(sig=name, action=name, depth=i, parent=parent)
        nodes.append(n)
        parent = n
    return nodes


def test_least_recently_used_leaf_is_evicted_first():
    r = Residency(budget=250)
    a, b, c = Node("a", "a", 1), Node("b", "b", 1), Node("c", "c", 1)
    for n in (a, b, c):
        r.add(n, 100)
    assert list(r.resident) == [b, c] and r.evictions == 1
    r.touch(b)
    r.add(a, 100)
    assert list(r.resident) == [b, a]


def test_an_ancestor_stays_while_a_resident_descendant_needs_it():
    r = Residency(budget=300)
    root, mid, leaf = chain("root", "mid", "leaf")
    other = Node("other", "other", 1)
    for n in (root, mid, leaf):
        r.add(n, 100)
    r.add(other, 100)  # over budget: root is the oldest, but a resident descendant needs it
    assert list(r.resident) == [root, mid, other]  # the oldest node no one needs goes: leaf
    r.add(Node("y", "y", 1), 100)  # now mid is a leaf of the resident set and goes before root
    assert root in r.resident and mid not in r.resident


def test_touching_a_node_refreshes_its_ancestors():
    r = Residency(budget=1000)
    root, mid, leaf = chain("root", "mid", "leaf")
    x = Node("x", "x", 1)
    for n in (root, mid, leaf, x):
        r.add(n, 10)
    r.touch(leaf)
    assert list(r.resident)[-3:] == [root, mid, leaf]
