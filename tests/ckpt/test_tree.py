"""ckpt.tree: the one walker of nested state."""

from __future__ import annotations

from collections import OrderedDict

from ckpt.tree import DESCEND, descend_containers, leaves, transform


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
