"""PromptLoader: batch sizes, epoch boundaries (last partial batch dropped), per-epoch seeded shuffling, every item
once per epoch, and resuming from ``state_dict`` mid-epoch and across an epoch boundary."""

import itertools

import numpy as np
import pytest

from megatron_pacs.data.loader import PromptLoader

ITEMS = [f"q{i}" for i in range(10)]


def take(loader, k):
    return [loader.next_batch() for _ in range(k)]


def documented_order(n, seed, epoch):
    """Epoch ``epoch``'s permutation as the docstring specifies: a generator seeded from the independent stream
    ``SeedSequence(seed, spawn_key=(0, epoch))`` permutes ``range(n)``."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0, epoch)))
    return [int(i) for i in rng.permutation(n)]


def test_seed_and_epoch_streams_are_independent():
    """No two (seed, epoch) pairs share an order: ``seed + epoch`` made seed s's epoch 1 replay seed s+1's epoch 0,
    so a seed sweep trained on shifted copies of one another's data orders."""
    items = list(range(64))
    orders = {}
    for seed in range(10):
        loader = PromptLoader(items, 64, seed=seed)
        for epoch in range(10):
            orders[(seed, epoch)] = tuple(loader.next_batch())
            assert loader.epoch == epoch
    assert len(set(orders.values())) == 100, "two (seed, epoch) pairs share a data order"
    for a, b in itertools.combinations(orders, 2):
        assert orders[a] != orders[b], (a, b)


def test_batch_size_larger_than_dataset_is_rejected():
    with pytest.raises(ValueError, match="exceeds the 10 training prompts"):
        PromptLoader(ITEMS, 11, seed=0)
    assert len(PromptLoader(ITEMS, 10, seed=0).next_batch()) == 10


@pytest.mark.parametrize(("n", "batch_size"), [(10, 2), (10, 5), (10, 10), (7, 1), (12, 4)])
def test_divisible_epochs_cover_every_item_once(n, batch_size):
    items = list(range(n))
    loader = PromptLoader(items, batch_size, seed=3)
    per_epoch = n // batch_size
    for epoch in range(3):
        batches = take(loader, per_epoch)
        assert all(len(b) == batch_size for b in batches)
        assert sorted(i for b in batches for i in b) == items
        assert loader.epoch == epoch


@pytest.mark.parametrize(("n", "batch_size"), [(10, 3), (10, 4), (7, 2), (5, 3), (10, 6)])
def test_partial_epochs_drop_the_tail(n, batch_size):
    items = list(range(n))
    loader = PromptLoader(items, batch_size, seed=1)
    per_epoch = n // batch_size
    for epoch in range(3):
        batches = take(loader, per_epoch)
        assert loader.epoch == epoch
        seen = [i for b in batches for i in b]
        assert all(len(b) == batch_size for b in batches)
        assert len(seen) == len(set(seen)) == per_epoch * batch_size  # no item twice within an epoch
        assert set(seen) <= set(items)
        # The batches are the head of this epoch's permutation; its tail is dropped.
        assert seen == documented_order(n, 1, epoch)[: per_epoch * batch_size]
    # The next batch starts a new epoch at position 0.
    loader.next_batch()
    assert (loader.epoch, loader.position) == (3, batch_size)


def position(loader):
    state = loader.state_dict()
    return {"epoch": state["epoch"], "position": state["position"]}


def test_epoch_and_position_counters():
    loader = PromptLoader(ITEMS, 4, seed=0)
    assert position(loader) == {"epoch": 0, "position": 0}
    loader.next_batch()
    assert position(loader) == {"epoch": 0, "position": 4}
    loader.next_batch()
    assert position(loader) == {"epoch": 0, "position": 8}
    loader.next_batch()  # only 2 items left: a new epoch
    assert position(loader) == {"epoch": 1, "position": 4}
    assert loader.state_dict()["num_items"] == 10


def test_a_position_saved_for_other_data_is_refused():
    """The saved position carries the data set's fingerprint (items and order); another data set, or
    the same prompts in another order, is refused instead of silently skipping and repeating prompts."""
    saved = PromptLoader(ITEMS, 4, seed=0)
    saved.next_batch()
    state = saved.state_dict()
    PromptLoader(list(ITEMS), 4, seed=0).load_state_dict(state)  # the same data: fine
    for other in (ITEMS[:-1], [*ITEMS, "q10"], list(reversed(ITEMS))):
        with pytest.raises(ValueError, match="--train-data: the checkpoint's data position belongs to another"):
            PromptLoader(other, 4, seed=0).load_state_dict(state)
    legacy = {"epoch": 0, "position": 4}  # checkpoints written before the fingerprint: position only
    PromptLoader(ITEMS[:-1], 4, seed=0).load_state_dict(legacy)


def test_items_are_returned_not_indices():
    items = [{"id": i} for i in range(6)]
    batch = PromptLoader(items, 3, seed=0).next_batch()
    assert all(any(b is it for it in items) for b in batch)


def test_same_seed_same_order():
    a = take(PromptLoader(ITEMS, 3, seed=7), 10)
    b = take(PromptLoader(ITEMS, 3, seed=7), 10)
    assert a == b


def test_different_seed_different_order():
    orders = {tuple(i for b in take(PromptLoader(ITEMS, 5, seed=s), 2) for i in b) for s in range(5)}
    assert len(orders) == 5


def test_order_is_shuffled_and_changes_between_epochs():
    items = list(range(20))
    loader = PromptLoader(items, 20, seed=0)
    epochs = [loader.next_batch() for _ in range(4)]
    assert all(sorted(e) == items for e in epochs)
    assert all(e != items for e in epochs)  # not the identity (vanishingly unlikely for a seeded shuffle of 20)
    assert len({tuple(e) for e in epochs}) == 4


def test_epoch_permutation_matches_documented_seeding():
    loader = PromptLoader(ITEMS, 5, seed=11)
    for epoch in range(3):
        seen = [i for b in take(loader, 2) for i in b]
        assert seen == [ITEMS[i] for i in documented_order(10, 11, epoch)]


@pytest.mark.parametrize(("n", "batch_size"), [(10, 3), (10, 5), (7, 2), (6, 6)])
def test_resume_gives_the_uninterrupted_continuation(n, batch_size):
    items = list(range(n))
    total = 4 * (n // batch_size) + 3  # several epochs
    reference = take(PromptLoader(items, batch_size, seed=5), total)
    for stop in range(total):  # every cut point: mid-epoch, at the end of an epoch, right after a new one begins
        first = PromptLoader(items, batch_size, seed=5)
        head = take(first, stop)
        state = first.state_dict()
        resumed = PromptLoader(items, batch_size, seed=5)
        resumed.load_state_dict(dict(state))
        assert head + take(resumed, total - stop) == reference, f"resumed after {stop} batches ({state})"


def test_resume_across_an_epoch_boundary():
    loader = PromptLoader(ITEMS, 4, seed=2)
    take(loader, 2)  # the end of epoch 0's usable items (8 of 10)
    state = loader.state_dict()
    assert position(loader) == {"epoch": 0, "position": 8}
    expected = take(loader, 3)  # epoch 1 begins
    resumed = PromptLoader(ITEMS, 4, seed=2)
    resumed.load_state_dict(state)
    assert take(resumed, 3) == expected
    # Epoch 1 held two batches (positions 4 and 8), the third batch opened epoch 2.
    assert resumed.state_dict() == loader.state_dict()
    assert position(resumed) == {"epoch": 2, "position": 4}


def test_load_state_dict_accepts_serialized_values():
    # A checkpoint read back from JSON or a tensor dump may carry strings or floats: they are cast to int.
    loader = PromptLoader(ITEMS, 2, seed=4)
    take(loader, 7)  # epoch 1, position 4
    state = loader.state_dict()
    expected = take(loader, 4)
    resumed = PromptLoader(ITEMS, 2, seed=4)
    resumed.load_state_dict({"epoch": str(state["epoch"]), "position": float(state["position"])})
    assert resumed.state_dict() == state
    assert take(resumed, 4) == expected


def test_state_dict_is_a_copy():
    loader = PromptLoader(ITEMS, 2, seed=0)
    state = loader.state_dict()
    loader.next_batch()
    assert {k: state[k] for k in ("epoch", "position")} == {"epoch": 0, "position": 0}


def _rows(n):
    from megatron_pacs.data.prompts import PromptRow

    return [
        PromptRow(
            id=str(i),
            data_source="d",
            prompt=[{"role": "user", "content": f"q{i}"}],
            ground_truth=str(i),
            question=f"q{i}",
        )
        for i in range(n)
    ]


def test_a_row_whose_content_changed_is_refused_unless_allowed():
    """The fingerprint covers the rows' content: a corrected answer under the same id is refused on
    resume (it would train on other data than the record says) unless ``allow_changed_rows``; a state written before
    the content fingerprint (ids only) still resumes, its ids fingerprint computed as before."""
    import dataclasses
    import hashlib

    rows = _rows(8)
    loader = PromptLoader(rows, 4, seed=0)
    loader.next_batch()
    state = loader.state_dict()
    changed = [*rows[:3], dataclasses.replace(rows[3], ground_truth="99"), *rows[4:]]
    resumed = PromptLoader(changed, 4, seed=0)
    with pytest.raises(ValueError, match=r"--train-data: .*content changed .*--allow-changed-rows"):
        resumed.load_state_dict(state)
    resumed.load_state_dict(state, allow_changed_rows=True)
    assert resumed.position == 4 and resumed.next_batch() == take(PromptLoader(changed, 4, seed=0), 2)[1]
    legacy = {k: v for k, v in state.items() if k != "content_fingerprint"}
    PromptLoader(changed, 4, seed=0).load_state_dict(legacy)
    ids = hashlib.sha256(b"".join(repr(("d", str(i))).encode() + b"\n" for i in range(8))).hexdigest()
    assert state["fingerprint"] == ids
    with pytest.raises(ValueError, match=r"another data set"):
        PromptLoader(_rows(9)[1:], 4, seed=0).load_state_dict(legacy)
