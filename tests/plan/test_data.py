"""GlobalBatches: the documented order rule, nothing dropped or repeated, rank shares, data kinds."""

import itertools

import pytest
import torch
from _fit_models import epoch_order
from torch.utils.data import DataLoader, Dataset, TensorDataset

from autoaccum.plan.data import GlobalBatches
from autoaccum.plan.plan import rank_share


def _ids(n: int) -> torch.Tensor:
    return torch.arange(n) * 10  # sample i is the value 10 * i: batches show which samples they hold


def _flat(batches) -> list[int]:
    return [int(v) // 10 for rb in batches for v in rb.batch]


@pytest.mark.parametrize("seed", [0, 3])
def test_order_follows_the_documented_rule(seed):
    n, target = 150, 64
    gb = GlobalBatches(_ids(n), target, seed=seed)
    assert gb.steps_per_epoch == 3
    for epoch in range(3):
        batches = list(gb.epoch(epoch))
        expected = epoch_order(n, seed, epoch)
        assert [len(rb.batch) for rb in batches] == [64, 64, 22]
        assert [rb.partial for rb in batches] == [False, False, True]
        assert [rb.global_size for rb in batches] == [64, 64, 22]
        assert [rb.index for rb in batches] == [0, 1, 2] and {rb.epoch for rb in batches} == {epoch}
        assert _flat(batches) == expected.tolist()  # every sample exactly once, in the rule's order


def test_epochs_and_seeds_give_other_orders():
    gb0, gb1 = GlobalBatches(_ids(150), 64, seed=0), GlobalBatches(_ids(150), 64, seed=1)
    assert _flat(gb0.epoch(0)) != _flat(gb0.epoch(1))
    assert _flat(gb0.epoch(0)) != _flat(gb1.epoch(0))
    assert _flat(gb0.epoch(1)) != _flat(gb1.epoch(0))  # seed and epoch do not alias
    assert _flat(gb0.epoch(2)) == _flat(GlobalBatches(_ids(150), 64, seed=0).epoch(2))  # reproducible


def test_start_resumes_mid_epoch():
    gb = GlobalBatches(_ids(150), 64, seed=2)
    full = list(gb.epoch(1))
    rest = list(gb.epoch(1, 1))
    assert [rb.index for rb in rest] == [1, 2]
    assert all(torch.equal(a.batch, b.batch) for a, b in zip(full[1:], rest))
    assert list(gb.epoch(1, 3)) == []


def test_exact_multiple_has_no_partial_batch():
    batches = list(GlobalBatches(_ids(128), 64).epoch(0))
    assert [len(rb.batch) for rb in batches] == [64, 64] and not any(rb.partial for rb in batches)


@pytest.mark.parametrize(("target", "world"), [(64, 2), (65, 2), (64, 3), (10, 4)])
def test_rank_shares_cover_each_global_batch_in_rank_order(target, world):
    n = 150
    per_rank = [list(GlobalBatches(_ids(n), target, seed=1, rank=r, world_size=world).epoch(0))
                for r in range(world)]
    whole = list(GlobalBatches(_ids(n), target, seed=1).epoch(0))
    for step, rb in enumerate(whole):
        shares = [per_rank[r][step] for r in range(world)]
        assert torch.equal(torch.cat([s.batch for s in shares]), rb.batch)
        sizes = [len(s.batch) for s in shares]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
        assert {s.global_size for s in shares} == {len(rb.batch)}


def test_rank_share():
    assert [rank_share(10, r, 3) for r in range(3)] == [slice(0, 4), slice(4, 7), slice(7, 10)]
    assert [rank_share(1, r, 2) for r in range(2)] == [slice(0, 1), slice(1, 1)]


def test_tuple_of_tensors_stays_aligned():
    x, y = _ids(150), _ids(150) + 1
    for rb in GlobalBatches((x, y), 64, seed=4).epoch(0):
        bx, by = rb.batch
        assert torch.equal(bx + 1, by)


class _DictDataset(Dataset):
    def __len__(self):
        return 150

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "y": i}


def test_map_style_dataset_is_collated_in_the_same_order():
    batches = list(GlobalBatches(_DictDataset(), 64, seed=3).epoch(0))
    assert [set(rb.batch) for rb in batches] == [{"x", "y"}] * 3
    assert torch.cat([rb.batch["y"] for rb in batches]).tolist() == epoch_order(150, 3, 0).tolist()
    assert batches[0].batch["x"].shape == (64, 2)
    # a TensorDataset collates to the same values as the tuple of tensors
    x, y = _ids(150).float(), _ids(150)
    for a, b in zip(GlobalBatches(TensorDataset(x, y), 64).epoch(0), GlobalBatches((x, y), 64).epoch(0)):
        assert all(torch.equal(u, v) for u, v in zip(a.batch, b.batch))


def test_sample_is_the_head_of_epoch_zero():
    gb = GlobalBatches(_ids(150), 64, seed=5)
    assert (gb.sample(7) // 10).tolist() == epoch_order(150, 5, 0)[:7].tolist()
    with pytest.raises(ValueError, match="holds only 150"):
        gb.sample(151)


def test_loader_batches_pass_through_with_the_last_one_partial():
    loader = DataLoader(TensorDataset(_ids(150)), batch_size=64)
    gb = GlobalBatches(loader, 64)
    assert not gb.is_indexed and gb.steps_per_epoch == 3
    for epoch in range(2):  # a DataLoader is re-iterated every epoch
        batches = list(gb.epoch(epoch))
        assert [len(rb.batch[0]) for rb in batches] == [64, 64, 22]
        assert [rb.partial for rb in batches] == [False, False, True]
    assert [rb.index for rb in gb.epoch(0, 2)] == [2]


def test_a_small_batch_before_the_end_is_refused():
    # a loader with batch_size 32 for target_batch 64 would silently halve the global batch
    gb = GlobalBatches(DataLoader(TensorDataset(_ids(150)), batch_size=32), 64)
    with pytest.raises(ValueError, match="32 samples.*every batch but the last"):
        list(gb.epoch(0))


def test_a_too_large_batch_is_refused():
    gb = GlobalBatches(DataLoader(TensorDataset(_ids(150)), batch_size=65), 64)
    with pytest.raises(ValueError, match="65 samples"):
        list(gb.epoch(0))


def test_probing_a_generator_drops_no_batch():
    batches = [_ids(64) + i for i in range(3)]
    gb = GlobalBatches(iter(batches), 64)
    assert torch.equal(gb.sample(5), batches[0][:5])
    assert torch.equal(gb.sample(9), batches[0][:9])  # the same head, not the next batch
    seen = list(gb.epoch(0))
    assert len(seen) == 3 and all(torch.equal(rb.batch, b) for rb, b in zip(seen, batches))
    assert list(gb.epoch(1)) == []  # a one-shot iterator is exhausted after one pass


def test_probing_a_loader_leaves_the_global_rng_alone():
    loader = DataLoader(TensorDataset(_ids(150)), batch_size=64, shuffle=True)
    gb = GlobalBatches(loader, 64)
    before = torch.get_rng_state()
    gb.sample(4)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("data", [torch.zeros(0, 3), (torch.zeros(0), torch.zeros(0)), [], (), _DictDataset.__new__(
    type("Empty", (_DictDataset,), {"__len__": lambda self: 0})), DataLoader(TensorDataset(torch.zeros(0)),
                                                                              batch_size=4)])
def test_empty_data_is_refused(data):
    with pytest.raises(ValueError, match="empty"):
        GlobalBatches(data, 8)


def test_an_empty_generator_is_refused_when_sampled():
    gb = GlobalBatches(iter([]), 8)
    with pytest.raises(ValueError, match="no batch"):
        gb.sample(1)


def test_tensors_disagreeing_in_dim_0_are_refused():
    with pytest.raises(ValueError, match=r"disagree in dim 0 \(sizes \['10', '9'\]\)"):
        GlobalBatches((torch.zeros(10, 2), torch.zeros(9)), 4)
    with pytest.raises(ValueError, match="disagree in dim 0"):
        GlobalBatches((torch.zeros(10), torch.tensor(1.0)), 4)


def test_wrong_kinds_are_refused():
    with pytest.raises(TypeError, match="tuple or dict of tensors, a map-style Dataset or an iterable"):
        GlobalBatches(42, 8)
    with pytest.raises(TypeError, match="target_batch must be an int"):
        GlobalBatches(_ids(10), 8.0)
    with pytest.raises(ValueError, match="fewer than the 4 ranks"):
        GlobalBatches(_ids(3), 8, world_size=4)


def test_every_sample_once_over_many_shapes():
    for n, target in itertools.product([1, 7, 64, 65, 127], [1, 8, 64]):
        gb = GlobalBatches(_ids(n), target, seed=n)
        flat = _flat(gb.epoch(0))
        assert sorted(flat) == list(range(n)) and gb.steps_per_epoch == -(-n // target)


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(_ids(self.n))  # single samples: 0-d tensors


class _SizedStream(_Stream):
    def __len__(self):
        return self.n


def test_an_iterable_dataset_is_cut_in_its_order_into_rank_shares_of_global_batches():
    """Every sample once per epoch, in the stream's order, each global batch split over the ranks in rank order;
    the last batch holds what remains ("step") or is left out ("drop"); a resume skips whole global batches."""
    n, target, world = 50, 16, 3
    ranks = [GlobalBatches(_Stream(n), target, rank=r, world_size=world) for r in range(world)]
    per_rank = [list(gb.epoch(0)) for gb in ranks]
    assert [[len(rb.batch) for rb in rbs] for rbs in per_rank] == [[6, 6, 6, 1], [5, 5, 5, 1], [5, 5, 5, 0]]
    assert [rb.global_size for rb in per_rank[0]] == [16, 16, 16, 2] and per_rank[0][-1].partial
    joined = [int(v) // 10 for step in zip(*per_rank) for rb in step for v in rb.batch]
    assert joined == list(range(n))  # nothing dropped, nothing repeated, the stream's order
    assert _flat(GlobalBatches(_Stream(n), target).epoch(0, start=2)) == list(range(32, 50))
    assert _flat(GlobalBatches(_Stream(n), target, last_batch="drop").epoch(0)) == list(range(48))
    assert GlobalBatches(_Stream(n), target).steps_per_epoch is None  # unknown length
    sized = GlobalBatches(_SizedStream(n), target)
    assert (sized.steps_per_epoch, sized.last_global_size) == (4, 2)
    assert [int(v) // 10 for v in sized.sample(3)] == [0, 1, 2]  # the probe's samples: the stream's first


def test_eval_batches_are_compared_with_training_batches_but_the_batch_and_sequence_dims():
    def rows(n, length, width=None):
        ids = torch.ones(n, length, dtype=torch.long) if width is None else torch.ones(n, length, width)
        return {"input_ids": ids, "attention_mask": torch.ones(n, length, dtype=torch.long)}

    train = GlobalBatches(rows(8, 12), 4, by_length=True)
    GlobalBatches(rows(6, 9), 4, by_length=True, name="eval_data").check_like(train)  # other lengths: the same data
    with pytest.raises(ValueError, match=r"eval_data\['input_ids'\] is a torch.float32 tensor of shape \[\*, \*, 5\], "
                                         r"data\['input_ids'\] is a torch.int64 tensor of shape \[\*, \*\]"):
        GlobalBatches(rows(6, 9, width=5), 4, by_length=True, name="eval_data").check_like(train)
    with pytest.raises(ValueError, match=r"eval_data\[0\] is a torch.float32 tensor of shape \[\*, 9\], data\[0\] is"
                                         r" a torch.float32 tensor of shape \[\*, 12\]"):  # fixed shapes: dim 1 counts
        GlobalBatches((torch.ones(6, 9),), 4, name="eval_data").check_like(GlobalBatches((torch.ones(8, 12),), 4))
