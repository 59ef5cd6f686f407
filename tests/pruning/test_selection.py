import pytest
import torch

from hfl.pruning.selection import (
    SparseGradient,
    lowest_magnitude,
    prune_and_grow,
    top_pruned_gradients,
)

# One layer of 6 entries, 4 kept (positions 0, 1, 3, 4).
WEIGHT = torch.tensor([[0.5, -0.1, 0.0], [0.3, -0.9, 5.0]])  # 5.0: a stale value under the mask
MASK = torch.tensor([[True, True, False], [True, True, False]])
GRADIENT = torch.tensor([[9.0, 9.0, -0.2], [9.0, 9.0, 0.7]])


def test_theta_low_is_the_smallest_kept_entries():
    weight = torch.tensor([[0.5, -0.1, 0.01], [0.3, -0.9, -0.02]])  # pruned entries are smaller still
    low = lowest_magnitude({"w": weight}, {"w": MASK}, {"w": 2})["w"]
    assert low.tolist() == [[False, True, False], [True, False, False]]  # |-0.1|, |0.3|
    assert int(low.sum()) == 2 and not (low & ~MASK).any()


def test_theta_low_marks_only_what_the_server_can_drop():
    """A layer ERK keeps dense loses nothing at an adjustment, so BaE marks nothing in it; elsewhere
    at most the layer's pruned entries (what can grow back)."""
    weight = torch.tensor([[0.5, -0.1, 0.01], [0.3, -0.9, -0.02]])
    low = lowest_magnitude({"w": weight, "dense": weight}, {"w": MASK, "dense": torch.ones(2, 3, dtype=torch.bool)}, {"w": 3, "dense": 3})
    assert not low["dense"].any()
    assert int(low["w"].sum()) == 2  # ξ = 3 capped by the 2 pruned entries, as prune_and_grow caps it


def test_prune_and_grow_swaps_exactly_the_smallest_weights_for_the_largest_gradients():
    masks, weights = prune_and_grow({"w": WEIGHT, "b": torch.ones(2)}, {"w": MASK}, {"w": GRADIENT}, {"w": 1})
    # drop |-0.1| at (0, 1); grow |0.7| at (1, 2), at zero; the large gradients of kept entries don't count
    assert masks["w"].tolist() == [[True, False, False], [True, True, True]]
    assert torch.equal(weights["w"], torch.tensor([[0.5, 0.0, 0.0], [0.3, -0.9, 0.0]]))
    assert int(masks["w"].sum()) == int(MASK.sum())
    assert torch.equal(weights["b"], torch.ones(2))  # no mask: untouched


def test_prune_and_grow_never_swaps_more_than_the_pruned_entries():
    masks, _ = prune_and_grow({"w": WEIGHT}, {"w": MASK}, {"w": GRADIENT}, {"w": 3})
    assert masks["w"].tolist() == [[True, False, True], [False, True, True]]  # only 2 could grow


def test_client_reports_the_largest_gradients_among_pruned_entries():
    gradient = torch.tensor([[9.0, 9.0, -0.2], [9.0, 9.0, 0.7], [0.0, 0.1, -0.5]])
    mask = torch.tensor([[True, True, False], [True, True, False], [True, False, False]])
    top = top_pruned_gradients({"w": gradient}, {"w": mask}, {"w": 2})["w"]
    assert sorted(top.indices.tolist()) == [5, 8]
    assert sorted(top.values.tolist()) == [-0.5, pytest.approx(0.7)]
    assert torch.equal(top.dense(), torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.7], [0.0, 0.0, -0.5]]))


def test_sparse_gradient_dense_places_values():
    sparse = SparseGradient(torch.tensor([1.0, 2.0]), torch.tensor([3, 0]), torch.Size([2, 2]))
    assert sparse.dense().tolist() == [[2.0, 0.0], [0.0, 1.0]]
