"""ckpt.tree: the one walker of nested state; copy_tree rebuilds as transform does and fills its holes in place."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import pytest

from ckpt.tree import DESCEND, HOLE, copy_tree, descend_containers, leaves, transform


def test_leaves_in_order_and_only_into_the_given_containers():
    tree = {"a": [1, (2, 3)], "b": OrderedDict(c=4), "d": {}}
    assert list(leaves(tree)) == [1, 2, 3, 4]
    assert list(leaves(tree, into=(dict, list))) == [1, (2, 3), 4]
    assert list(leaves(5)) == [5]


def test_transform_rebuilds_plain_containers_with_paths():
    seen = []

    def visit(node, path):
        seen.append(path)
        if isinstance(node, (dict, list, tuple)):
            return DESCEND
        return node * 10

    tree = {"a": [1, (2, 3)], "b": OrderedDict(c=4)}
    out = transform(tree, visit)
    assert out == {"a": [10, (20, 30)], "b": {"c": 40}} and type(out["b"]) is dict
    assert type(out["a"][1]) is tuple
    assert seen == [(), ("a",), ("a", 0), ("a", 1), ("a", 1, 0), ("a", 1, 1), ("b",), ("b", "c")]
    assert tree == {"a": [1, (2, 3)], "b": OrderedDict(c=4)}  # the input is untouched


def test_a_visitor_may_stop_descending():
    out = transform({"keep": [1, 2], "walk": [3]},
                    lambda node, path: node if path == ("keep",) else DESCEND)
    assert out == {"keep": [1, 2], "walk": [3]}
    assert transform([1, [2]], descend_containers(lambda x: -x)) == [-1, [-2]]


def test_copy_tree_rebuilds_as_transform_does():
    from collections import namedtuple

    pair = namedtuple("pair", "x y")
    tree = {"a": [1, (2, (3, [4]))], "b": OrderedDict(c=pair(5, 6)), "d": ()}
    copied = copy_tree(tree, lambda x: x * 10).fill([])
    assert copied == transform(tree, descend_containers(lambda x: x * 10))
    assert type(copied["b"]) is dict and type(copied["b"]["c"]) is tuple and type(copied["a"][1][1]) is tuple


def test_copy_tree_holes_are_filled_in_place_in_order():
    tree = {"a": ["t1", ("t2", ("t3", 1))], "b": {"c": "t4"}, "e": 2}
    skeleton = copy_tree(tree, lambda x: HOLE if str(x).startswith("t") else x)
    assert skeleton.fill(["T1", "T2", "T3", "T4"]) == {"a": ["T1", ("T2", ("T3", 1))], "b": {"c": "T4"}, "e": 2}
    assert copy_tree("t", lambda x: HOLE).fill(["T"]) == "T"
    assert copy_tree(("t", 1), lambda x: HOLE if x == "t" else x).fill(["T"]) == ("T", 1)
    for values in (["T"], ["T"] * 3):
        with pytest.raises(ValueError):
            copy_tree(["t", "t"], lambda x: HOLE).fill(values)


def test_copy_tree_sees_a_class_registered_as_a_mapping_later():
    class Box:
        def __init__(self, **items):
            self._items = items

        def items(self):
            return self._items.items()

    box = Box(a=1)
    assert copy_tree([box], lambda x: x).fill([]) == [box]
    Mapping.register(Box)
    assert copy_tree([box], lambda x: x).fill([]) == [{"a": 1}]
