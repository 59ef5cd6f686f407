"""`hfl budget`'s sparse table counts pruned weights both ways: masked-dense, as hfl trains them (the
measured peak), and as a sparse client stores them (values and positions in the appendix's storage)."""

import math

from hfl.backends.base import ClientEnvironment
from hfl.budget import sparse_rows, table_method
from tests.conftest import small_config


def stored_bytes_by_hand(n, rows, kept):
    """The appendix's storage of one float32 tensor of n entries in `rows` rows keeping `kept`."""
    density, values = kept / n, 32 * kept
    if density >= 0.9:
        bits = 32 * n
    elif density >= 0.3:
        bits = n + values  # bitmap
    elif density >= 0.1:
        bits = kept * math.ceil(math.log2(n)) + values  # coordinates
    else:  # CSR: column indices and row pointers
        bits = kept * math.ceil(math.log2(n // rows)) + rows * math.ceil(math.log2(kept)) + values
    return -(-bits // 8)


def test_the_sparse_peak_holds_each_pruned_weight_as_values_and_positions():
    config = small_config(method={"name": "fedtiny", "adjust_every": 1}, model={"name": "cnn"})
    env = ClientEnvironment.from_config(config)
    rows = {(r["method"], r["sparsity"]): r for r in sparse_rows(config, env, (0.8, 0.95))}
    dense = rows["fedavg", 0.0]
    assert dense["sparse_peak_bytes"] == dense["peak_bytes"]  # nothing pruned, nothing saved
    for sparsity in (0.8, 0.95):
        masks = table_method(config, env, "fedtiny", sparsity).init_state().masks
        saving = sum(4 * m.numel() - stored_bytes_by_hand(m.numel(), m.shape[0], int(m.sum())) for m in masks.values())
        assert saving > 0
        for method in ("flpqsu", "feddst", "fedtiny"):
            row = rows[method, sparsity]
            assert row["peak_bytes"] - row["sparse_peak_bytes"] == saving, method
        assert rows["fedtiny", sparsity]["peak_bytes"] == dense["peak_bytes"]  # masked-dense: FedAvg's
        assert rows["fedtiny", sparsity]["sparse_peak_bytes"] < dense["peak_bytes"]
