"""FL-PQSU as FedMef compares with it: one-shot magnitude pruning of the initial model, then FedAvg
with the mask fixed."""

import pytest
import torch

from hfl.accounting.cost import tensor_bytes
from hfl.loggers import read_metrics
from hfl.pruning.masks import erk_counts, magnitude_masks
from hfl.server import initial_state
from tests.conftest import run_with_env, small_config


def test_magnitude_masks_keep_each_layers_largest_entries():
    state = {"a": torch.tensor([[0.5, -3.0], [0.1, 2.0]]), "b": torch.arange(-4.0, 5.0).view(3, 3)}
    masks = magnitude_masks(state, ["a", "b"], 0.5)
    counts = erk_counts({k: v.shape for k, v in state.items()}, 0.5)
    for key, mask in masks.items():
        assert int(mask.sum()) == counts[key]
        kept, dropped = state[key].abs()[mask], state[key].abs()[~mask]
        assert kept.min() >= dropped.max()


@pytest.mark.slow
def test_the_mask_never_changes_pruned_weights_stay_zero_kept_ones_move_and_uploads_are_sparse(tmp_path, monkeypatch):
    config = small_config(method={"name": "flpqsu", "sparsity": 0.8}, model={"name": "preresnet20"}, fl={"rounds": 3, "clients": 4, "fraction": 1.0})
    summary, env, final = run_with_env(config, tmp_path, monkeypatch)
    assert summary["client_rounds"] == 12
    masks = env.method.initial_masks
    start = initial_state(config, env).global_state
    kept = sum(int(m.sum()) for m in masks.values())
    assert abs(kept / sum(m.numel() for m in masks.values()) - 0.2) < 0.01
    # the pruned start keeps exactly the mask's entries, so pruning it again by magnitude gives the same mask
    again = magnitude_masks(start, list(masks), 0.8)
    for key, mask in masks.items():
        assert torch.equal(again[key], mask), key
        assert not final["global_state"][key][~mask].any() and not start[key][~mask].any()  # pruned: zero from start to end
        assert torch.equal(final["global_state"][key] != start[key], mask), key  # every kept entry moved, no pruned one
    assert any(not torch.equal(final["global_state"][k], start[k]) for k in masks)
    # every client-round receives and sends the kept entries only, in the sparse storage of their density
    sent = [c["bytes_up"] for r in read_metrics(tmp_path) for c in r["clients"]]
    dense = tensor_bytes(start)
    assert set(sent) == {tensor_bytes(start, masks)} and len(sent) == 12
    assert tensor_bytes(start, masks) == 307_516 and dense == 1_093_632  # 28 % of the dense model's bytes
