"""FedTiny (and FedMef, which adjusts its mask the same way): the server's mask changes only in
adjustment rounds, keeps each layer's count, pruned weights stay zero, and the clients' top-k
gradients are uploaded, and counted, in adjustment rounds only."""

import pytest
import torch

from hfl.accounting.cost import tensor_bytes
from hfl.methods.fedtiny import (
    POSITIONS,
    VALUES,
    FedTiny,
    SparseTrainingState,
    averaged_gradients,
)
from hfl.pruning.masks import erk_counts
from hfl.types import ClientUpdate, RoundContext, TrainSettings
from tests.conftest import method_for, run_with_env, small_config


@pytest.mark.parametrize("method", ["fedtiny", "fedmef"])
def test_mask_changes_only_in_adjustment_rounds_and_pruned_weights_stay_zero(tmp_path, monkeypatch, method):
    rounds = []
    aggregate = FedTiny.aggregate

    def recording(self, global_state, updates, state):
        new_state, new_method_state = aggregate(self, global_state, updates, state)
        rounds.append((state, new_method_state, new_state, updates))
        return new_state, new_method_state

    monkeypatch.setattr(FedTiny, "aggregate", recording)
    config = small_config(method={"name": method, "sparsity": 0.8, "adjust_every": 2, "stop_round": 10}, model={"name": "cnn"},
                          fl={"rounds": 4, "clients": 3, "fraction": 1.0})
    _, env, final = run_with_env(config, tmp_path, monkeypatch)
    initial = env.method.init_state().masks
    shapes = {k: m.shape for k, m in initial.items()}
    assert {k: int(m.sum()) for k, m in initial.items()} == erk_counts(shapes, 0.8)
    for r, (before, after, weights, updates) in enumerate(rounds, start=1):
        adjusting = r % 2 == 0
        changed = [k for k in before.masks if not torch.equal(before.masks[k], after.masks[k])]
        assert bool(changed) == adjusting, r
        for key, mask in after.masks.items():
            assert int(mask.sum()) == int(initial[key].sum()), (r, key)  # prune/grow keeps each layer's count
            assert not weights[key][~mask].any(), (r, key)  # pruned (and just dropped) entries are zero
        for update in updates:
            for key, mask in before.masks.items():
                assert not update.state[key][~mask].any(), (r, key)  # the client kept them zero while training
            assert bool(update.extras) == adjusting, r
            weights_only = tensor_bytes(update.state, before.masks)
            assert update.metrics["bytes_up"] == weights_only + tensor_bytes(update.extras), r
            assert (update.metrics["bytes_up"] > weights_only) == adjusting, r
    last = rounds[-1][1].masks  # the checkpoint holds the mask, for an exact resume
    assert all(torch.equal(final["method_state"].masks[k], m) for k, m in last.items())


def test_server_grows_the_largest_averaged_gradients_weighted_by_samples():
    """Two clients of 1 and 3 samples report gradients at two pruned entries: the server averages
    them weighted by samples, grows both (the only nonzero |ḡ|) at 0 and drops as many of the smallest kept |θ̄|."""
    method = method_for({"name": "fedtiny", "adjust_every": 1, "stop_round": 100})
    key = max(method.initial_masks, key=lambda k: method.initial_masks[k].numel())  # the sparsest (ERK) layer
    state = method.init_state()
    mask = state.masks[key]
    global_state = method.initial_global_state()
    pruned = (~mask).flatten().nonzero().flatten()
    a, b = int(pruned[0]), int(pruned[1])
    counts = method.adjustment_counts(1, state.masks)
    assert counts[key] >= 1

    def update(weight, value_a, value_b):
        extras = {}
        for k in state.masks:
            if k == key:
                extras[k + VALUES], extras[k + POSITIONS] = torch.tensor([value_a, value_b]), torch.tensor([a, b], dtype=torch.int32)
            else:
                extras[k + VALUES], extras[k + POSITIONS] = torch.zeros(0), torch.zeros(0, dtype=torch.int32)
        spec = method.plan(RoundContext(1, 0, 0, 4, TrainSettings(0.1, 0.0, 0.0, 1, 4)), state).spec
        return ClientUpdate(0, {k: v.clone() for k, v in global_state.items()}, weight, spec, {}, None, extras)

    updates = [update(1.0, 4.0, 0.0), update(3.0, 0.0, 2.0)]
    averaged = averaged_gradients(updates, {k: global_state[k] for k in state.masks})[key].flatten()
    assert averaged[a] == 1.0 and averaged[b] == 1.5  # (1·4 + 3·0)/4 and (1·0 + 3·2)/4
    assert averaged.count_nonzero() == 2
    new_weights, new_state = method.aggregate(global_state, updates, state)
    grown = (new_state.masks[key] & ~mask).flatten().nonzero().flatten().tolist()
    assert counts[key] >= 2 and a in grown and b in grown
    kept = global_state[key].abs().flatten()[mask.flatten()]
    dropped = (mask & ~new_state.masks[key]).flatten().nonzero().flatten()
    assert len(dropped) == len(grown)
    assert global_state[key].abs().flatten()[dropped].max() <= kept.sort().values[len(dropped) - 1]
    assert new_weights[key].flatten()[grown].eq(0).all()
    assert isinstance(new_state, SparseTrainingState) and new_state.rounds == 1
