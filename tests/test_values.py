"""`shape_of` and `concat_values`: one meaning for tensors, numpy arrays and nested lists."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from safelens import CacheShapeError, concat_values, shape_of


def test_shape_of_every_kind():
    assert shape_of(torch.zeros(2, 5, 4, 8)) == (2, 5, 4, 8)
    assert shape_of(np.zeros((3, 1))) == (3, 1)
    assert shape_of([[[1], [3]]]) == (1, 2, 1)
    assert shape_of(([1, 2], [3, 4])) == (2, 2)
    assert shape_of([]) == (0,)
    assert shape_of([[]]) == (1, 0)
    assert shape_of(7) is None
    assert shape_of(None) is None


def test_concat_none_returns_new_itself():
    new = torch.ones(1, 2, 3)
    assert concat_values(None, new) is new
    new_list = [[[5]]]
    assert concat_values(None, new_list, dim=1) is new_list


def test_concat_empty_list_is_new():
    assert concat_values([], [1, 2], dim=0) == [1, 2]


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
def test_nested_lists_concat_like_numpy_at_any_depth(dim):
    old = np.arange(2 * 2 * 3).reshape(2, 2, 3)
    new = np.arange(100, 100 + 2 * 2 * 3).reshape(2, 2, 3)
    expected = np.concatenate([old, new], axis=dim).tolist()
    assert concat_values(old.tolist(), new.tolist(), dim=dim) == expected


def test_spec_list_example():
    assert concat_values([[[1]]], [[[3]]], dim=1) == [[[1], [3]]]


@pytest.mark.parametrize("dim", [0, 1, 2, 3, -1, -2, -3, -4])
def test_tensors_and_arrays_along_any_axis(dim):
    old = torch.randn(2, 3, 4, 5)
    new = torch.randn(2, 3, 4, 5)
    assert torch.equal(concat_values(old, new, dim=dim), torch.cat([old, new], dim=dim))
    joined = concat_values(old.numpy(), new.numpy(), dim=dim)
    assert isinstance(joined, np.ndarray)
    np.testing.assert_array_equal(joined, np.concatenate([old.numpy(), new.numpy()], dim))


def test_new_value_takes_the_kind_dtype_and_device_of_old():
    old = torch.zeros(1, 1, 2, dtype=torch.bfloat16)
    from_numpy = concat_values(old, np.ones((1, 1, 2), dtype=np.float64), dim=1)
    assert from_numpy.dtype == torch.bfloat16 and from_numpy.shape == (1, 2, 2)
    from_list = concat_values(old, [[[3.0, 4.0]]], dim=1)
    assert from_list.dtype == torch.bfloat16
    assert from_list[0, 1].tolist() == [3.0, 4.0]
    from_double = concat_values(old, torch.ones(1, 1, 2, dtype=torch.float64), dim=1)
    assert from_double.dtype == torch.bfloat16

    array = concat_values(np.zeros((1, 1), dtype=np.float32), torch.ones(1, 1), dim=1)
    assert isinstance(array, np.ndarray) and array.dtype == np.float32
    assert array.tolist() == [[0.0, 1.0]]

    listed = concat_values([[0]], np.array([[7]]), dim=1)
    assert listed == [[0, 7]] and isinstance(listed, list)
    assert concat_values([[0]], torch.tensor([[7]]), dim=1) == [[0, 7]]


@pytest.mark.parametrize(
    ("old", "new", "dim", "match"),
    [
        (torch.zeros(1, 2, 3), torch.zeros(1, 2), 1, r"same rank"),
        (torch.zeros(1, 2, 3), torch.zeros(2, 2, 3), 1, r"every axis but 1 must match"),
        (torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), 3, r"dim=3.*dim inside it"),
        (np.zeros((1, 2)), np.zeros((1, 2, 1)), -1, r"cached shape \(1, 2\)"),
        ([[1, 2]], [[3], [4]], 1, r"every axis but 1 must match"),
    ],
)
def test_mismatched_shapes_raise(old, new, dim, match):
    with pytest.raises(CacheShapeError, match=match):
        concat_values(old, new, dim=dim)


def test_unjoinable_kind_raises():
    with pytest.raises(CacheShapeError, match="cannot concatenate values of type int"):
        concat_values(3, 4)


# Integers numpy holds as int64: past that range numpy promotes a uint64 array joined
# with an int64 one to float64, a numpy rule, not one of joining lists.
int64 = st.integers(-(2**63), 2**63 - 1)
nested = st.integers(1, 3).flatmap(
    lambda a: st.integers(1, 3).flatmap(
        lambda b: st.tuples(
            st.lists(st.lists(int64, min_size=b, max_size=b), min_size=a, max_size=a),
            st.lists(st.lists(int64, min_size=b, max_size=b), min_size=a, max_size=a),
        )
    )
)


@given(nested)
def test_list_concat_last_axis_matches_numpy(pair):
    old, new = pair
    expected = np.concatenate([np.array(old), np.array(new)], axis=-1).tolist()
    assert concat_values(old, new, dim=-1) == expected
    assert shape_of(concat_values(old, new, dim=-1)) == np.array(expected).shape
