"""The masked weighted mean: FedAvg on full updates, per-entry averages on partial ones."""

import torch

from hfl.submodel import SubmodelSpec
from hfl.submodel.aggregate import masked_weighted_mean
from hfl.types import ClientUpdate


def update(state, weight, spec=None):
    return ClientUpdate(0, state, weight, spec or SubmodelSpec(), {})


def test_full_updates_give_the_weighted_average():
    g = {"w": torch.zeros(3), "steps": torch.tensor(4)}
    a = update({"w": torch.tensor([1.0, 2.0, 3.0]), "steps": torch.tensor(5)}, 1)
    b = update({"w": torch.tensor([3.0, 2.0, 1.0]), "steps": torch.tensor(7)}, 3)
    new = masked_weighted_mean(g, [a, b])
    torch.testing.assert_close(new["w"], torch.tensor([2.5, 2.0, 1.5]))
    assert int(new["steps"]) == 7


def test_partial_updates_average_only_over_holders():
    g = {"w": torch.full((4,), 9.0), "untouched": torch.ones(2)}
    prefix = SubmodelSpec(width=0.5, indices={"w": {0: torch.tensor([0, 1])}})
    rolled = SubmodelSpec(width=0.5, indices={"w": {0: torch.tensor([3, 0])}})
    masked = SubmodelSpec(masks={"w": torch.tensor([True, False, True, True])})
    updates = [
        update({"w": torch.tensor([1.0, 2.0])}, 1, prefix),
        update({"w": torch.tensor([4.0, 3.0])}, 2, rolled),  # entries 3 and 0
        update({"w": torch.tensor([5.0, 0.0, 5.0, 5.0])}, 1, masked),  # entry 1 pruned
    ]
    new = masked_weighted_mean(g, updates)
    expected = torch.tensor([(1 * 1 + 2 * 3 + 1 * 5) / 4, 2.0, 5.0, (2 * 4 + 1 * 5) / 3])
    torch.testing.assert_close(new["w"], expected)
    assert torch.equal(new["untouched"], g["untouched"])


def test_two_dimensional_indices():
    g = {"w": torch.zeros(3, 3)}
    spec = SubmodelSpec(indices={"w": {0: torch.tensor([2, 0]), 1: torch.tensor([1, 2])}})
    new = masked_weighted_mean(g, [update({"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, 1, spec)])
    torch.testing.assert_close(new["w"], torch.tensor([[0.0, 3.0, 4.0], [0.0, 0.0, 0.0], [0.0, 1.0, 2.0]]))


def test_masks_on_the_cpu_meet_a_global_state_on_another_device():
    """Sparse methods keep their masks on the CPU while the server's state may live on a GPU (the
    meta device stands in for it: it refuses CPU operands just as CUDA does). An H100 run of FedTiny
    failed here, in its first aggregation."""
    g = {"w": torch.zeros(4, device="meta")}
    masked = SubmodelSpec(masks={"w": torch.tensor([True, False, True, True])})
    new = masked_weighted_mean(g, [update({"w": torch.ones(4, device="meta")}, 1, masked)])
    assert new["w"].device.type == "meta" and new["w"].shape == (4,)


def test_entries_no_client_held_keep_their_global_value():
    """From a non-zero global state (zeros would hide a mean that zero-fills what nobody held): the
    entries inside some client's window or mask are averaged over their holders, every other entry
    of the tensor keeps its global value exactly."""
    g = {"w": torch.arange(1.0, 10.0).reshape(3, 3)}
    window = SubmodelSpec(indices={"w": {0: torch.tensor([2, 0]), 1: torch.tensor([1, 2])}})  # rows 2, 0 x columns 1, 2
    pruned = SubmodelSpec(masks={"w": torch.tensor([[False, True, False], [False, False, False], [False, False, True]])})
    updates = [update({"w": torch.tensor([[10.0, 20.0], [30.0, 40.0]])}, 1, window),
               update({"w": torch.full((3, 3), 70.0)}, 3, pruned)]  # holds (0, 1) and (2, 2) only
    new = masked_weighted_mean(g, updates)
    expected = torch.tensor([[1.0, (30 + 3 * 70) / 4, 40.0],
                             [4.0, 5.0, 6.0],
                             [7.0, 10.0, (20 + 3 * 70) / 4]])
    torch.testing.assert_close(new["w"], expected, rtol=0, atol=0)
