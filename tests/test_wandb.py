"""wandb as the dashboard, offline: what a run writes is read back from its `.wandb` file (records of
wandb's protobuf schema in a LevelDB-style log), not only checked to exist."""

import json
import time
from pathlib import Path

import pytest

from hfl.loggers import WandbLogger, client_table, read_metrics, round_row, wandb_run_id
from hfl.server import run_experiment
from tests.conftest import small_config

TWO_TIERS = {"scenario": "tiers", "memory": ["width:1/2", "width:1"], "shares": [0.5, 0.5]}
BLOCK, HEADER = 32768, 7  # wandb's transaction log: 32 KiB blocks, a 7-byte header per chunk


def wandb_records(run_dir: Path, timeout_s: float = 30) -> list:
    """Every record of the run's offline `.wandb` file, in order, once it is complete: wandb's service
    writes the file after `run.finish()` returns (a first run's after a second or two), ending it
    with an exit record."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        records = parse_wandb_file(path.read_bytes())
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} holds no exit record after {timeout_s} s"
        time.sleep(0.1)


def parse_wandb_file(data: bytes) -> list:
    from wandb.proto import wandb_internal_pb2

    if len(data) < HEADER:
        return []
    assert data[:4] == b":W&B"
    records, chunk, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < HEADER or (length, kind) == (0, 0):  # the block's padding
            pos += left
            continue
        chunk += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def items(updates) -> dict:
    """Key -> value of wandb history/summary/config items (nested keys joined by '.')."""
    return {".".join(u.nested_key) or u.key: json.loads(u.value_json) for u in updates}


@pytest.fixture(scope="module")
def heterofl_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("wandb") / "heterofl"
    config = small_config(method={"name": "heterofl", "widths": [1.0, 0.5]}, budgets=TWO_TIERS, fl={"rounds": 2},
                          logging={"wandb": True, "wandb_group": "widths-on-digits", "wandb_checkpoint": True})
    with pytest.MonkeyPatch.context() as env:  # the autouse offline fixture is per test; this run is per module
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        summary = run_experiment(config, out)
    return config, out, summary, wandb_records(out)


def history_rows(records) -> dict[int, dict]:
    """Round -> the wandb history row logged at that step (each round once: a second row fails)."""
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = items(r.history.item)
            assert row["_step"] not in rows, f"round {row['_step']} logged twice"
            rows[row["_step"]] = row
    return rows


def final_summary(records) -> dict:
    final = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            final.update(items(r.summary.update))
    return final


@pytest.mark.slow
def test_an_offline_run_holds_submodel_and_tier_metrics_under_a_unique_id(heterofl_run):
    config, out, summary, records = heterofl_run
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == run.display_name == wandb_run_id(config, out) and run.run_id.startswith("test-") and "-s0-" in run.run_id
    assert (run.run_group, run.job_type) == ("widths-on-digits", "heterofl")
    logged = items(run.config.update)
    assert logged["method"]["widths"] == [1.0, 0.5] and logged["budgets"]["memory"] == ["width:1/2", "width:1"]

    history = history_rows(records)
    lines = read_metrics(out)
    assert sorted(history) == [1, 2]
    for line in lines:
        row = history[line["round"]]
        assert row["accuracy"] == line["accuracy"] and row["round"] == line["round"]
        submodels = {f"submodel_accuracy/{name}": acc for name, acc in line["submodel_accuracy"].items()}
        assert {k: v for k, v in row.items() if k.startswith("submodel_accuracy/")} == submodels
        # what a sweep ranks by, every round
        assert row["worst_submodel_accuracy"] == min(submodels.values())
        assert row["mean_submodel_accuracy"] == pytest.approx(sum(submodels.values()) / len(submodels))
        assert row["violations/memory"] == row["budget_violations"] == 0 and row["flops_violations"] == 0
        for tier in ("w1", "w1_2"):
            members = [c for c in line["clients"] if c["tier"] == tier]
            assert row[f"tiers/{tier}/clients"] == len(members) > 0
            assert row[f"tiers/{tier}/mean_estimated_peak_bytes"] == sum(c["estimated_peak_bytes"] for c in members) / len(members)
            assert row[f"tiers/{tier}/accuracy"] == pytest.approx(
                sum(line["submodel_accuracy"][c["level"]] for c in members) / len(members))
            assert row[f"tiers/{tier}/budget_violations"] == 0
        assert not [k for k in row if k.startswith("tier/")]  # one namespace for tiers, as summary.json's
        assert row["client_resources._type"] == "table-file" and row["client_resources.nrows"] == len(line["clients"])

    # `round` is every key's step; a score's summary keeps its best and its last value
    defined = {r.metric.name: r.metric for r in records if r.WhichOneof("record_type") == "metric"}
    assert defined["worst_submodel_accuracy"].step_metric == "round" and defined["loss"].step_metric == "round"
    final = final_summary(records)
    worst = [history[r]["worst_submodel_accuracy"] for r in (1, 2)]
    assert final["worst_submodel_accuracy"] == {"max": max(worst), "last": summary["worst_submodel_accuracy"]}
    assert final["loss"]["min"] == min(history[r]["loss"] for r in (1, 2))
    assert final["submodel_accuracy/x0.5"]["last"] == summary["submodel_accuracy"]["x0.5"]
    assert final["final_accuracy"] == summary["final_accuracy"] and final["tiers/w1/budget_bytes"] == summary["tiers"]["w1"]["budget_bytes"]
    assert final["budget_violations"]["last"] == summary["budget_violations"] == 0
    # the final checkpoint, as an offline artifact (logging.wandb_checkpoint)
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact" and r.artifact.type == "model"]
    assert artifact.name == f"{run.run_id}-checkpoint" and "final" in artifact.aliases


def test_round_rows_count_violations_per_round_per_tier_and_so_far():
    """Budgets broken in a round: counted in it, per tier, and in the run's totals since round 1."""
    from hfl.scores import RoundScores

    def client(tier, peak, budget, flops=1, level="x1"):
        return {"id": 0, "tier": tier, "level": level, "estimated_peak_bytes": peak, "budget_bytes": budget, "flops": flops,
                "budget_flops": 10, "bytes_up": 1, "budget_upload_bytes": None}

    scores = RoundScores()
    first = round_row({"round": 1, "accuracy": 0.5, "submodel_accuracy": {"x1": 0.6, "x0.5": 0.4},
                       "clients": [client("a", 5, 4), client("a", 3, 4, flops=11, level="x0.5"), client("b", 9, 4)]}, scores)
    assert (first["violations/memory"], first["violations/flops"], first["violations/upload"]) == (2, 1, 0)
    assert (first["tiers/a/violations/memory"], first["tiers/b/violations/memory"], first["tiers/a/flops_violations"]) == (1, 1, 1)
    assert first["tiers/a/accuracy"] == pytest.approx(0.5) and first["tiers/b/accuracy"] == 0.6
    second = round_row({"round": 2, "accuracy": None, "clients": [client("b", 9, 4)]}, scores)
    assert (second["violations/memory"], second["budget_violations"], second["tiers/b/budget_violations"]) == (1, 3, 2)
    assert "worst_submodel_accuracy" not in second and "tiers/b/accuracy" not in second  # not evaluated this round
    plain = round_row({"round": 1, "accuracy": 0.7, "clients": []})
    assert plain["worst_submodel_accuracy"] == plain["mean_submodel_accuracy"] == 0.7  # one model: as a sweep ranks FedAvg


@pytest.mark.slow
def test_the_client_table_of_a_round_holds_each_clients_resources(heterofl_run):
    _, out, _, records = heterofl_run
    last = read_metrics(out)[-1]
    (path,) = [items(r.history.item)["client_resources.path"] for r in records
               if r.WhichOneof("record_type") == "history" and items(r.history.item)["_step"] == last["round"]]
    (files,) = out.glob("wandb/offline-run-*/files")
    table = json.loads((files / path).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [(r["id"], r["tier"], r["estimated_peak_bytes"], r["bytes_up"], r["submodel/width"]) for r in rows] == [
        (c["id"], c["tier"], c["estimated_peak_bytes"], c["bytes_up"], c["submodel"]["width"]) for c in last["clients"]]


def test_run_ids_differ_by_config_seed_and_folder_but_not_by_paths_or_logging(tmp_path):
    base = small_config()
    assert wandb_run_id(base, tmp_path) == wandb_run_id(
        small_config(logging={"wandb": True, "wandb_group": "x"}, data={"root": str(tmp_path)}), tmp_path)
    others = {wandb_run_id(c, tmp_path) for c in (base, small_config(fl={"lr": 0.01}), small_config(seed=1), small_config(name="other"),
                                                  small_config(method={"name": "heterofl"}))}
    assert len(others) == 5
    assert wandb_run_id(base, tmp_path / "a") != wandb_run_id(base, tmp_path / "b")  # the same config in two folders
    assert wandb_run_id(small_config(name="a/b c"), tmp_path).startswith("a_b_c-")


@pytest.mark.slow  # an end-to-end run of 3-5 s: CI runs it, the fast lane does not
def test_a_resumed_run_keeps_its_wandb_id_and_a_trial_logs_its_swept_values(tmp_path):
    config = small_config(fl={"rounds": 1}, logging={"wandb": True})
    run_experiment(config, tmp_path)
    longer = small_config(fl={"rounds": 2}, logging={"wandb": True})  # another hash: rounds were raised
    assert wandb_run_id(longer, tmp_path) != wandb_run_id(config, tmp_path)
    logger = WandbLogger(longer, tmp_path, resume=True, swept={"fl.lr": 0.05})
    assert logger.run.id == wandb_run_id(config, tmp_path)
    assert logger.run.config["swept"] == {"fl.lr": 0.05}
    logger.close()
    logger.close()  # once only: a stopped trial's close, then nothing


def test_round_rows_flatten_nested_records_with_slashes():
    record = {"round": 3, "accuracy": 0.5, "loss": None, "exit_accuracy": {"block3": 0.4, "block6": 0.5}, "ensemble_accuracy": 0.55,
              "failed_clients": [{"id": 1}], "clients": [
                  {"id": 0, "tier": "a", "train_loss": 1.0, "flops": 10, "estimated_peak_bytes": 5, "bytes_up": 2,
                   "submodel": {"width": 0.5, "dropped_blocks": [1]}},
                  {"id": 1, "tier": "a", "train_loss": 3.0, "flops": 30, "estimated_peak_bytes": 5, "bytes_up": 2,
                   "submodel": {"width": 1.0, "dropped_blocks": []}}]}
    row = round_row(record)
    assert row["exit_accuracy/block3"] == 0.4 and row["ensemble_accuracy"] == 0.55 and "loss" not in row
    assert (row["failed_clients"], row["skipped_clients"], row["tiers/a/clients"], row["tiers/a/mean_flops"]) == (1, 0, 2, 20)
    columns, rows = client_table(record["clients"])
    assert columns == ["id", "tier", "train_loss", "flops", "estimated_peak_bytes", "bytes_up", "submodel/width", "submodel/dropped_blocks"]
    assert rows[0] == [0, "a", 1.0, 10, 5, 2, 0.5, "[1]"]


def test_a_comparison_script_groups_its_runs_by_its_folder(tmp_path):
    from tests.test_compare_scripts import ROOT, calls_of

    calls = calls_of(ROOT / "experiments" / "scalefl_cifar10" / "compare.sh", tmp_path, "--seeds", "0,1", "logging.wandb=true")
    runs = [c for c in calls if c[0] == "run"]
    assert len(runs) == 16 and all("logging.wandb_group=out" in c and "logging.wandb=true" in c for c in runs)


def test_online_without_an_api_key_is_a_config_error_naming_the_mode(tmp_path, monkeypatch):
    """No key in the environment or under HOME: one line naming logging.wandb_mode, before any round."""
    from hfl.errors import ConfigError

    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = small_config(logging={"wandb": True, "wandb_mode": "online"})
    with pytest.raises(ConfigError, match=r"logging.wandb_mode='online'.*wandb login"):
        WandbLogger(config, tmp_path / "run", resume=False)


def test_each_keys_summary_keeps_its_best_value_in_the_right_direction():
    from hfl.loggers import summary_kind

    for key in ("accuracy", "worst_submodel_accuracy", "submodel_accuracy/x0.5", "exit_accuracy/exit2", "tiers/w1_2/accuracy"):
        assert summary_kind(key) == "max,last", key
    for key in ("loss", "perplexity", "budget_violations", "violations/memory", "tiers/w1/violations/flops", "tiers/w1/budget_violations",
                "inference_peak_bytes", "tiers/w1/mean_estimated_peak_bytes", "tiers/w1/mean_flops", "clients/mean_train_loss"):
        assert summary_kind(key) == "min,last", key


@pytest.mark.slow
def test_a_run_with_devices_plots_every_key_against_simulated_time(tmp_path, monkeypatch):
    """Devices give each round a simulated end: logged as `simulated_time`, the step metric of every
    other key, so a dashboard draws accuracy against simulated seconds (`round` is still logged)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = small_config(fl={"rounds": 2}, logging={"wandb": True},
                          budgets={"scenario": "tiers", "memory": ["width:1", "width:1"], "names": ["slow", "fast"]},
                          devices={"source": "tiers", "speed": ["1e8", "2e9"], "down": ["250kB", "4MB"], "up": ["100kB", "2MB"]})
    run_experiment(config, tmp_path)
    records = wandb_records(tmp_path)
    defined = {r.metric.name: r.metric for r in records if r.WhichOneof("record_type") == "metric"}
    assert defined["accuracy"].step_metric == defined["loss"].step_metric == "simulated_time"
    assert defined["tiers/slow/mean_flops"].step_metric == "simulated_time" and not defined["simulated_time"].step_metric
    history = history_rows(records)
    lines = read_metrics(tmp_path)
    assert [(history[r["round"]]["simulated_time"], history[r["round"]]["round"], history[r["round"]]["accuracy"]) for r in lines] == [
        (r["sim_end_s"], r["round"], r["accuracy"]) for r in lines]
    assert lines[0]["sim_end_s"] < lines[1]["sim_end_s"]
    assert final_summary(records)["simulated_time"] == {"last": lines[-1]["sim_end_s"]}
