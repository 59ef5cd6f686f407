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


def test_a_pruning_runs_client_rounds_carry_the_peak_with_sparse_weights_and_a_dense_runs_do_not(tmp_path):
    """metrics.jsonl names both figures of a pruning method's client-round: `estimated_peak_bytes`
    (masked-dense, what budgets are checked against) and `estimated_sparse_peak_bytes` (its pruned
    weights as values and positions); summary.json and `hfl report` carry their means."""
    import json

    from hfl.loggers import read_metrics
    from hfl.report import comparison_rows, load_run
    from hfl.server import SUMMARY, run_experiment

    # A batch as large as each client's data, so that the clients' peaks differ and a mean is not a maximum.
    pruned = small_config(method={"name": "fedtiny", "sparsity": 0.9}, fl={"rounds": 1, "batch_size": 512},
                          data={"partition": "dirichlet_unbalanced"})
    masks = ClientEnvironment.from_config(pruned).method.init_state().masks  # the first round's, as the run builds them
    saving = sum(4 * m.numel() - stored_bytes_by_hand(m.numel(), m.shape[0], int(m.sum())) for m in masks.values())
    run_experiment(pruned, tmp_path / "fedtiny")
    run_experiment(small_config(fl={"rounds": 1}), tmp_path / "fedavg")

    clients = read_metrics(tmp_path / "fedtiny")[0]["clients"]
    assert len({c["estimated_peak_bytes"] for c in clients}) > 1 and saving > 0
    assert all(c["estimated_peak_bytes"] - c["estimated_sparse_peak_bytes"] == saving for c in clients)
    assert not any("estimated_sparse_peak_bytes" in c for c in read_metrics(tmp_path / "fedavg")[0]["clients"])
    summary = json.loads((tmp_path / "fedtiny" / SUMMARY).read_text())
    assert summary["mean_estimated_sparse_peak_bytes"] == summary["mean_estimated_peak_bytes"] - saving
    assert summary["max_estimated_sparse_peak_bytes"] == summary["max_estimated_peak_bytes"] - saving
    assert "mean_estimated_sparse_peak_bytes" not in json.loads((tmp_path / "fedavg" / SUMMARY).read_text())

    headers, rows = comparison_rows([load_run(tmp_path / "fedtiny"), load_run(tmp_path / "fedavg")])
    column = headers.index("mean peak MiB, sparse weights")
    assert float(rows[0][column]) == round((summary["mean_estimated_peak_bytes"] - saving) / 2**20, 2) and rows[1][column] == "-"
