import pytest
from hypothesis import given, strategies as st

from omniwalk.graph import FixedChunks, LeftContext, SlidingWindow, StreamBuffer


def drain(policy, count, push_sizes=None):
    buffer = StreamBuffer(policy)
    chunks = []
    items = list(range(count))
    sizes = push_sizes or [1] * count
    position = 0
    for size in sizes:
        buffer.push(items[position : position + size])
        position += size
        while (chunk := buffer.pop_ready()) is not None:
            chunks.append(chunk)
    buffer.push(items[position:])
    buffer.close()
    while (chunk := buffer.pop_ready()) is not None:
        chunks.append(chunk)
    return chunks


def test_fixed_chunks():
    chunks = drain(FixedChunks(3), 8)
    assert [c.items for c in chunks] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [c.is_final for c in chunks] == [False, False, True]
    assert drain(FixedChunks(3), 6)[-1].items == [] and drain(FixedChunks(3), 6)[-1].is_final


def test_sliding_window():
    chunks = drain(SlidingWindow(4, 1), 6)
    assert [c.items for c in chunks] == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], []]
    assert [c.num_new for c in chunks] == [4, 1, 1, 0]
    # fewer items than a window: the final chunk flushes what there is
    chunks = drain(SlidingWindow(4, 1), 2)
    assert [(c.items, c.is_final) for c in chunks] == [([0, 1], True)]
    # stride 2 with a leftover item: the final window covers it
    chunks = drain(SlidingWindow(4, 2), 7)
    assert [c.items for c in chunks] == [[0, 1, 2, 3], [2, 3, 4, 5], [3, 4, 5, 6]]
    assert chunks[-1].num_new == 1


def test_left_context():
    chunks = drain(LeftContext(2, 1), 5)
    assert [(c.items, c.num_new) for c in chunks] == [([0, 1], 2), ([1, 2, 3], 2), ([3, 4], 1)]


def test_left_context_with_a_small_first_chunk():
    chunks = drain(LeftContext(3, 1, first_size=1), 6)
    assert [(c.items, c.num_new, c.is_final) for c in chunks] == [
        ([0], 1, False), ([0, 1, 2, 3], 3, False), ([3, 4, 5], 2, True)]


def test_left_context_growing_chunks():
    chunks = drain(LeftContext(4, 1, first_size=1, grow=True), 10)
    assert [(c.items, c.num_new) for c in chunks] == [
        ([0], 1), ([0, 1], 1), ([1, 2, 3], 2), ([3, 4, 5, 6, 7], 4), ([7, 8, 9], 2)]


def test_push_after_close_raises():
    buffer = StreamBuffer(FixedChunks(1))
    buffer.close()
    with pytest.raises(RuntimeError):
        buffer.push([1])


policies = st.one_of(
    st.builds(FixedChunks, st.integers(1, 5)),
    st.integers(1, 5).flatmap(lambda w: st.builds(SlidingWindow, st.just(w), st.integers(1, w))),
    st.builds(LeftContext, st.integers(1, 5), st.integers(0, 4), st.none() | st.integers(1, 5), st.booleans()),
)


@given(policies, st.integers(0, 30), st.lists(st.integers(0, 4), max_size=10))
def test_every_item_released_once_and_final_exactly_once(policy, count, sizes):
    chunks = drain(policy, count, sizes)
    finals = [c for c in chunks if c.is_final]
    assert len(finals) == 1 and chunks[-1].is_final
    new_items = [item for c in chunks for item in c.items[len(c.items) - c.num_new:]]
    assert new_items == list(range(count))
    for c in chunks:   # a chunk is a contiguous run of the stream
        assert c.items == list(range(c.start, c.start + len(c.items)))
