"""Splitting, sizing and moving batches (autoaccum.plan.batch)."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoaccum.plan.batch import batch_size, describe_batch, move_to, split_batch

Pair = namedtuple("Pair", ["x", "y"])


def _batch(n: int = 10) -> torch.Tensor:
    return torch.arange(n * 3, dtype=torch.float64).reshape(n, 3)


def test_split_tensor_even_and_uneven_sizes_are_consecutive_views():
    x = _batch(10)
    parts = split_batch(x, [4, 4, 2])
    assert [p.shape[0] for p in parts] == [4, 4, 2]
    assert torch.equal(torch.cat(parts), x)
    assert torch.equal(parts[1], x[4:8])
    assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in parts)  # views


def test_split_tuple_and_list_keep_their_type():
    x, y = _batch(7), torch.arange(7)
    for batch in ((x, y), [x, y]):
        parts = split_batch(batch, [3, 3, 1])
        assert [type(p) for p in parts] == [type(batch)] * 3
        assert torch.equal(parts[2][0], x[6:]) and torch.equal(parts[2][1], y[6:])


def test_split_nested_dict_with_non_tensor_leaves():
    batch = {"inputs": {"ids": torch.arange(6).reshape(6, 1), "mask": torch.ones(6, 4)},
             "labels": [torch.arange(6), (torch.zeros(6, 2),)], "name": "shard-3", "scale": torch.tensor(2.0)}
    parts = split_batch(batch, [2, 4])
    assert torch.equal(parts[0]["inputs"]["ids"], torch.arange(2).reshape(2, 1))
    assert parts[1]["inputs"]["mask"].shape == (4, 4)
    assert torch.equal(parts[1]["labels"][0], torch.arange(2, 6))
    assert isinstance(parts[1]["labels"][1], tuple) and parts[1]["labels"][1][0].shape == (4, 2)
    assert parts[0]["name"] == parts[1]["name"] == "shard-3"  # shared by every part
    assert parts[1]["scale"] is batch["scale"]  # 0-dim: not per sample, shared
    assert batch_size(batch) == 6


def test_split_ordered_dict_and_namedtuple_keep_their_type():
    od = OrderedDict(b=torch.arange(5), a=torch.ones(5, 2))
    parts = split_batch(od, [3, 2])
    assert type(parts[0]) is OrderedDict and list(parts[0]) == ["b", "a"]
    nt = Pair(torch.arange(5), torch.ones(5, 2))
    parts = split_batch(nt, [1, 4])
    assert type(parts[1]) is Pair and torch.equal(parts[1].x, torch.arange(1, 5))


def test_split_and_move_defaultdict_keep_type_and_factory():
    dd = defaultdict(list, x=torch.ones(4, 2))
    parts = split_batch(dd, [1, 3])
    assert type(parts[1]) is defaultdict and parts[1].default_factory is list and parts[1]["x"].shape == (3, 2)
    moved = move_to(dd, torch.device("meta"))
    assert type(moved) is defaultdict and moved["x"].device.type == "meta"


@dataclass
class Ragged:
    """A batch type the splitter does not know: a list of variable-length sequences."""

    seqs: list[torch.Tensor]


def _split_ragged(batch: Ragged, sizes):
    out, start = [], 0
    for s in sizes:
        out.append(Ragged(batch.seqs[start:start + s]))
        start += s
    return out


def test_custom_object_with_split_fn_and_size_fn():
    batch = Ragged([torch.ones(k) for k in (3, 1, 4, 1, 5)])
    parts = split_batch(batch, [2, 2, 1], _split_ragged)
    assert [len(p.seqs) for p in parts] == [2, 2, 1]
    assert parts[1].seqs[0] is batch.seqs[2]
    with pytest.raises(ValueError, match="cannot tell the batch size"):
        batch_size(batch)  # without size_fn the guard cannot count it


def test_split_fn_returning_the_wrong_number_of_parts_is_an_error():
    with pytest.raises(ValueError, match="returned 1 parts for 2 sizes"):
        split_batch(Ragged([torch.ones(1)] * 4), [2, 2], lambda b, s: [b])


@pytest.mark.parametrize("sizes", [[4, 4], [5, 6], [-1, 11], [10, 1, -1]])
def test_sizes_that_do_not_add_up_are_a_value_error(sizes):
    with pytest.raises(ValueError, match="add up to the batch size 10"):
        split_batch(_batch(10), sizes)


def test_tensors_disagreeing_in_dim0_are_a_value_error():
    bad = {"x": torch.ones(8, 2), "y": torch.ones(7)}
    with pytest.raises(ValueError, match=r"disagree in dim 0: sizes \[7, 8\]"):
        batch_size(bad)
    with pytest.raises(ValueError, match="disagree in dim 0"):
        split_batch(bad, [4, 4])


def test_batch_without_tensors_is_a_value_error():
    with pytest.raises(ValueError, match="cannot tell the batch size of a str"):
        batch_size("abc")
    with pytest.raises(ValueError, match="cannot tell the batch size"):
        batch_size(torch.tensor(3.0))  # a scalar holds no samples


def test_move_to_keeps_structure_and_skips_tensors_already_there():
    x = torch.ones(3, 2)
    batch = {"a": (x, [x]), "b": Pair(x, "tag"), "c": OrderedDict(z=x)}
    moved = move_to(batch, torch.device("cpu"))
    assert moved["a"][0] is x and moved["a"][1][0] is x
    assert type(moved["b"]) is Pair and moved["b"].y == "tag"
    assert type(moved["c"]) is OrderedDict
    moved = move_to(x, torch.device("meta"))
    assert moved.device.type == "meta" and moved.shape == x.shape


@pytest.mark.parametrize("make", [tuple, list, lambda ts: dict(enumerate(ts))], ids=["tuple", "list", "dict"])
def test_move_to_returns_a_flat_batch_already_there_as_it_is_and_moves_the_rest(make):
    """The fast path (once per micro-batch): a plain container of tensors all on the device comes back
    as it is; one tensor elsewhere, or copy=True, and every tensor is moved or copied into a new one."""
    cpu = [torch.ones(3, 2), torch.zeros(3, dtype=torch.int64)]
    batch = make(cpu)
    assert move_to(batch, torch.device("cpu")) is batch
    copied = move_to(batch, torch.device("cpu"), copy=True)
    assert copied is not batch and all(c is not t and torch.equal(c, t) for c, t in zip(_values(copied), cpu))
    mixed = make([cpu[0], torch.ones(3, 2, device="meta")])
    moved = move_to(mixed, torch.device("meta"))
    assert moved is not mixed and [t.device.type for t in _values(moved)] == ["meta", "meta"]
    moved = move_to(make(cpu), torch.device("meta"))
    assert [t.device.type for t in _values(moved)] == ["meta", "meta"]  # all elsewhere: moved too


def _values(batch):
    return list(batch.values()) if isinstance(batch, dict) else list(batch)


def test_describe_batch_lists_per_sample_shapes():
    assert describe_batch((torch.ones(4, 3), torch.zeros(4, dtype=torch.int64))) == \
        [[[3], "torch.float32"], [[], "torch.int64"]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=8))
def test_any_partition_reassembles_the_batch(sizes):
    n = sum(sizes)
    batch = {"x": torch.arange(n * 2).reshape(n, 2), "y": [torch.arange(n)]}
    parts = split_batch(batch, sizes)
    assert [p["x"].shape[0] for p in parts] == sizes
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert torch.equal(torch.cat([p["y"][0] for p in parts]), batch["y"][0])


def test_a_list_of_sample_pairs_is_refused_as_a_batch_with_the_fix_named():
    """``[(x_i, y_i), ...]`` was counted by its x's feature dim ("holds 20 samples"), then met a raw torch
    error; the guard refuses it before any work, naming default_collate."""
    import autoaccum

    torch.manual_seed(0)
    x, y = torch.randn(16, 20), torch.randint(0, 2, (16,))
    pairs = [(x[i], y[i]) for i in range(16)]
    with pytest.raises(ValueError, match=r"a list of 16 samples, each a tuple of 2 \(a torch.float32 tensor of "
                                         r"shape \[20\].*default_collate\(samples\)"):
        batch_size(pairs)
    with pytest.raises(ValueError, match="list of 5 samples"):  # a Python number as the label: samples too
        batch_size([(x[i], int(y[i])) for i in range(5)])
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def loss(m, b):
        calls.append(1)
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    guard = autoaccum.OOMGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), target_batch=16, micro_batch=4)
    with pytest.raises(ValueError, match="list of 16 samples"):
        guard.step(pairs, loss)
    assert calls == [] and all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    from torch.utils.data import default_collate

    assert guard.step(default_collate(pairs), loss).num_samples == 16  # the fix the message names works


def test_nested_batches_in_a_list_are_still_batches():
    """The negative control: a list of containers whose tensors all share dim 0 is a nested batch, not samples."""
    x, mask, y = torch.ones(4, 3), torch.ones(4, 3), torch.zeros(4, dtype=torch.int64)
    assert batch_size([(x, mask), (x, mask)]) == 4
    assert batch_size([{"ids": x}, y]) == 4
    assert batch_size([x, y]) == 4
