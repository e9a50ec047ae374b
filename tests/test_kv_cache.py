"""The target runner's KV cache (``engine/kv_cache.py``): a layer that appends in place behaves as transformers'
``DynamicLayer`` under every operation the runner applies (appends, crops, row selection, front crops and pads,
in-place row writes), copies only a forward's new columns while its buffer has room, and the runner uses it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from models import make_pair
from specdec_ext.engine.kv_cache import GrowingCache, GrowingLayer, compaction, copy_rows, take_rows
from specdec_ext.engine.runner import CausalLMRunner, pad_front

B, H, D = 3, 2, 4

op = st.one_of(
    st.tuples(st.just("update"), st.integers(1, 40)),
    st.tuples(st.just("crop"), st.integers(1, 30)),
    st.tuples(st.just("select"), st.lists(st.integers(0, B - 1), min_size=1, max_size=B)),
    st.tuples(st.just("leave"), st.sets(st.integers(0, B - 1), max_size=B - 1)),
    st.tuples(st.just("drop_front"), st.integers(1, 20)),
    st.tuples(st.just("pad_front"), st.integers(1, 20)),
    st.tuples(st.just("write_rows"), st.integers(0, 10)),
)


def apply(layer, name, arg, g, rows):
    """One operation on ``layer`` (the runner's, or transformers' through the layer's own methods); the random
    data comes from ``g`` so that both layers see the same."""
    n = layer.get_seq_length()
    if name == "update":
        k = torch.randn(rows, H, arg, D, generator=g)
        v = torch.randn(rows, H, arg, D, generator=g)
        return layer.update(k, v)
    if name == "crop" and n:
        layer.crop(-min(arg, n))
    elif name == "select" and n:
        layer.batch_select_indices(torch.tensor([i % rows for i in arg]))
    elif name == "leave" and n and len(arg) < rows:  # finished requests leave the batch (the engine's order)
        layer.batch_select_indices(torch.tensor(compaction(rows, {i for i in arg if i < rows})))
    elif name == "drop_front" and n:  # CausalLMRunner._drop_front
        m = min(arg, n)
        layer.keys, layer.values = layer.keys[:, :, m:], layer.values[:, :, m:]
    elif name == "pad_front" and n:  # CausalLMRunner._pad_front
        if isinstance(layer, GrowingLayer):
            layer.pad_front(arg)
        else:
            layer.keys = pad_front(layer.keys, n + arg, dim=2)
            layer.values = pad_front(layer.values, n + arg, dim=2)
    elif name == "write_rows" and n:  # CausalLMRunner._write_rows: a new request's columns written in place
        w = min(arg, n)
        k = torch.randn(1, H, w, D, generator=g)
        layer.keys[:1, :, n - w :] = k
        layer.values[:1, :, n - w :] = -k
    return None


@settings(max_examples=150, deadline=None)
@given(st.lists(op, min_size=1, max_size=25), st.integers(0, 2**31 - 1))
def test_growing_layer_equals_dynamic_layer(ops, seed):
    mine, theirs = GrowingLayer(), DynamicLayer()
    g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    rows = B
    for name, arg in [("update", 5), *ops]:
        a = apply(mine, name, arg, g1, rows)
        b = apply(theirs, name, arg, g2, rows)
        if a is not None:  # what the attention reads: the whole cache after the append
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert mine.get_seq_length() == theirs.get_seq_length()
        if theirs.get_seq_length():
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
            rows = theirs.keys.shape[0]


def test_appends_write_into_one_buffer_until_it_is_full():
    layer = GrowingLayer()
    layer.update(torch.zeros(2, H, 100, D), torch.zeros(2, H, 100, D))
    buffer = layer._kbuf
    assert buffer.shape[2] > 100  # spare columns
    total = 100
    while total + 3 <= buffer.shape[2]:
        k, _ = layer.update(torch.ones(2, H, 3, D), torch.ones(2, H, 3, D))
        total += 3
        assert layer._kbuf is buffer and k.data_ptr() == buffer.data_ptr() and k.shape[2] == total
        layer.crop(-1)  # a rejected candidate: the view shrinks, the buffer stays
        total -= 1
    layer.update(torch.ones(2, H, 3, D), torch.ones(2, H, 3, D))
    assert layer._kbuf is not buffer and layer._kbuf.shape[2] >= total + 3  # full: it grew


def test_row_selection_and_front_crop_keep_the_buffer_spare_columns():
    layer = GrowingLayer()
    layer.update(torch.randn(3, H, 50, D), torch.randn(3, H, 50, D))
    layer.batch_select_indices(torch.tensor([2, 0]))
    selected = layer._kbuf
    layer.keys, layer.values = layer.keys[:, :, 10:], layer.values[:, :, 10:]  # the runner's front crop
    layer.update(torch.randn(2, H, 2, D), torch.randn(2, H, 2, D))
    assert layer._kbuf is selected and layer.get_seq_length() == 42  # appended in place, no new buffer


def test_rows_that_leave_move_only_the_rows_that_take_their_places():
    assert compaction(6, [1, 4]) == [0, 5, 2, 3]  # row 5 takes row 1's place; row 4 was past the new size
    assert compaction(4, [2, 3]) == [0, 1] and compaction(3, []) == [0, 1, 2] and compaction(2, [0, 1]) == []
    t = torch.randn(6, H, 7, D)
    want = t[[0, 5, 2, 3]].clone()
    moved = take_rows(t, torch.tensor(compaction(6, [1, 4])))
    assert torch.equal(moved, want) and moved.data_ptr() == t.data_ptr()  # a view of the same buffer
    reordered = take_rows(t, torch.tensor([2, 0]))  # not rows leaving: a copy
    assert torch.equal(reordered, want[[2, 0]]) and reordered.data_ptr() != t.data_ptr()
    layer = GrowingLayer()
    layer.update(torch.randn(3, H, 50, D), torch.randn(3, H, 50, D))
    kept, buffer = layer.keys[[2, 1]].clone(), layer._kbuf
    layer.batch_select_indices(torch.tensor(compaction(3, [0])))
    assert torch.equal(layer.keys, kept) and layer._kbuf.data_ptr() == buffer.data_ptr()
    layer.update(torch.randn(2, H, 2, D), torch.randn(2, H, 2, D))
    assert layer._kbuf.data_ptr() == buffer.data_ptr() and layer.get_seq_length() == 52  # appends go on in place


@given(st.lists(st.integers(0, 5), min_size=0, max_size=6, unique=True), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_copy_rows_equals_an_indexed_assignment(dst_rows, seed):
    g = torch.Generator().manual_seed(seed)
    dst = torch.randn(6, H, 9, D, generator=g)
    src = torch.randn(4 + len(dst_rows), H, 5, D, generator=g)
    src_rows = torch.randperm(src.shape[0], generator=g)[: len(dst_rows)]
    want = dst.clone()
    want[torch.tensor(dst_rows, dtype=torch.int64), :, 4:] = src[src_rows]
    copy_rows(dst[:, :, 4:], torch.tensor(dst_rows, dtype=torch.int64), src, src_rows)  # into a column view
    assert torch.equal(dst, want)
    first = src[: len(dst_rows)]
    want[torch.tensor(dst_rows, dtype=torch.int64), :, 4:] = first
    copy_rows(dst[:, :, 4:], dst_rows, first)  # lists, and the source's rows in order
    assert torch.equal(dst, want)


def test_copy_rows_names_a_count_mismatch():
    with pytest.raises(ValueError, match="2 destination rows but 1 source rows"):
        copy_rows(torch.zeros(3, 2), [0, 1], torch.ones(3, 2), [2])


def test_front_padding_goes_into_the_spare_columns_before_the_view():
    layer = GrowingLayer()
    layer.update(torch.randn(2, H, 50, D), torch.randn(2, H, 50, D))
    old = layer.keys.clone()
    layer.pad_front(5)  # no spare columns before the view yet: new buffers, with spare columns at both ends
    buffer = layer._kbuf
    assert torch.equal(layer.keys[:, :, 5:], old) and not layer.keys[:, :, :5].any()
    layer.keys, layer.values = layer.keys[:, :, 20:], layer.values[:, :, 20:]  # the runner's front crop
    layer.pad_front(30)  # fits in the spare columns: in place
    assert layer._kbuf is buffer and layer.get_seq_length() == 65 and not layer.keys[:, :, :30].any()
    assert torch.equal(layer.keys[:, :, 30:], old[:, :, 15:])
    layer.update(torch.randn(2, H, 3, D), torch.randn(2, H, 3, D))
    assert layer._kbuf is buffer and layer.get_seq_length() == 68  # appends go on in the same buffer


def test_rows_placed_in_a_wider_batch_keep_spare_columns_for_the_next_appends():
    layer = GrowingLayer()
    k, v = torch.randn(2, H, 6, D), torch.randn(2, H, 6, D)
    layer.update(k, v)
    layer.place_rows(4, torch.tensor([3, 1]), 10)  # rows 3 and 1 of 4, right-aligned in 10 columns
    want = torch.zeros(4, H, 10, D)
    want[[3, 1], :, 4:] = k
    assert torch.equal(layer.keys, want) and layer.values[1, :, 4:].equal(v[1]) and not layer.values[0].any()
    buffer = layer._kbuf
    layer.update(torch.randn(4, H, 2, D), torch.randn(4, H, 2, D))
    assert layer._kbuf is buffer and layer.get_seq_length() == 12  # in place


def test_the_runner_uses_growing_layers():
    target, _ = make_pair("llama")
    runner = CausalLMRunner(target, "target")
    runner.start(2)
    assert isinstance(runner.cache, GrowingCache)
    runner.forward(torch.randint(2, target.config.vocab_size, (2, 5)))
    layers = runner._layers()
    assert len(layers) == target.config.num_hidden_layers
    assert all(isinstance(layer, GrowingLayer) and layer._kbuf is not None for layer in layers)
