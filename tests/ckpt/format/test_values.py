"""ckpt.format.values: non-tensor values as tagged JSON round-trip exactly; other types are refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ckpt.format import values
from tests.support import models


json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
    st.binary(max_size=8), st.sampled_from([float("inf"), float("-inf")]),
)
json_values = st.recursive(
    json_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers(), st.just("__ckpt__")), children, max_size=4),
    ),
    max_leaves=20,
)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(json_values)
def test_value_encoding_round_trips(value):
    import json

    encoded = json.loads(json.dumps(values.encode(value), allow_nan=False))
    models.assert_same(values.decode(encoded), value)


def test_unknown_value_types_are_not_json():
    with pytest.raises(values.NotJSONable):
        values.encode({1, 2})
    with pytest.raises(values.NotJSONable):
        values.encode(nn.Linear(1, 1))
