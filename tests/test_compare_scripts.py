"""The comparison scripts (`experiments/*/compare.sh`): which runs they start with `--seeds`, and
the per-model overrides they add, checked with a stand-in `hfl` on PATH that records its calls."""

import itertools
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "experiments").glob("*/compare.sh"))
PER_CONSTRAINT = {"caff_table1", "caff_table2"}
"""CAFF's grids name runs by constraint and method and choose each baseline's family member (own tests below)."""
SHARED_CONFIG = {"time_to_accuracy"}
"""Runs of one config with different overrides (tests/test_simulation.py checks them)."""
PER_BATCH = {"fedmef_small_batch"}
"""Every method at every batch size, and ablations of one config (own test below)."""
ONE_RUN_PER_CONFIG = [s for s in SCRIPTS if s.parent.name not in PER_CONSTRAINT | SHARED_CONFIG | PER_BATCH]


def calls_of(script, tmp_path, *args, env=None):
    """The argument lists `script OUT args...` passes to `hfl`, one per call (one line each)."""
    fake = tmp_path / "bin" / "hfl"
    fake.parent.mkdir(exist_ok=True)
    log = tmp_path / "calls.txt"
    # A run sleeps FAKE_RUN_SECONDS between "start" and "end" in `events.txt`, then logs its call.
    events = tmp_path / "events.txt"
    fake.write_text(f'#!/usr/bin/env bash\n[ "$1" = run ] && echo start >> {events} && sleep "${{FAKE_RUN_SECONDS:-0}}" && echo end >> {events}\n'
                    f'line=$(printf "%s\\t" "$@")\necho "$line" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, **(env or {}), "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", str(script), str(tmp_path / "out"), *args], check=True, env=env, capture_output=True)
    return [line.rstrip("\t").split("\t") for line in log.read_text().splitlines()]


def test_every_comparison_script_is_checked():
    assert {s.parent.name for s in SCRIPTS} == {"fedepth_table2", "fedmef_table1", "nefl_table1", "scalefl_cifar10", "scalefl_cifar10_equal_memory",
                                                "lm_pretrained_vs_random", *PER_CONSTRAINT, *SHARED_CONFIG, *PER_BATCH}


def test_fedmef_small_batch_runs_each_method_at_each_batch_size_and_the_ablations(tmp_path):
    """Figure 5: each method at each of `batches=`, the ablations (FedMef's config with their
    settings) at each of `ablation_batches=`, `method.*` overrides for the pruning methods only."""
    script = ROOT / "experiments" / "fedmef_small_batch" / "compare.sh"
    calls = calls_of(script, tmp_path, "--seeds", "0,2", "fl.rounds=1", "batches=1,4", "ablation_batches=2", "method.sparsity=0.8")
    runs, report = calls[:-1], calls[-1]
    ablations = {"fedmef_no_bae": ["method.bae=false"], "fedmef_no_sap": ["method.nsconv=false", "model.norm=bn"],
                 "fedmef_nsconv_only": ["method.bae=false", "method.activation_sparsity=0"]}
    expected = {f"{m}-b{b}-seed{s}": (m, b, s, []) for m in ("fedavg", "flpqsu", "feddst", "fedtiny", "fedmef") for b in (1, 4) for s in (0, 2)}
    expected |= {f"{v}-b2-seed{s}": ("fedmef", 2, s, settings) for v, settings in ablations.items() for s in (0, 2)}
    by_out = {Path(c[-1]).name: c for c in runs}
    assert len(runs) == len(by_out) and sorted(by_out) == sorted(expected)
    for name, (config, batch, seed, settings) in expected.items():
        call = by_out[name]
        assert Path(call[1]).stem == config and f"fl.batch_size={batch}" in call and f"seed={seed}" in call and "fl.rounds=1" in call
        assert all(s in call for s in settings), (name, call)
        assert ("method.sparsity=0.8" in call) == (config != "fedavg"), (name, call)
    assert report[0] == "report" and sorted(Path(r).name for r in report[1:-2]) == sorted(expected)
    refused = subprocess.run(["bash", str(script), str(tmp_path / "bad"), "batches=0"], capture_output=True, text=True, check=False)
    assert refused.returncode == 2 and "batch size 0" in refused.stderr


@pytest.mark.parametrize("script", ONE_RUN_PER_CONFIG, ids=lambda s: s.parent.name)
def test_seeds_run_every_method_once_per_seed_and_report_them_all(script, tmp_path):
    calls = calls_of(script, tmp_path, "--seeds", "0,2", "fl.rounds=1")
    runs, report = calls[:-1], calls[-1]
    assert all(c[0] == "run" and "fl.rounds=1" in c for c in runs)
    configs = sorted({Path(c[1]).stem for c in runs})
    expected = []
    for config in configs:
        for seed in (0, 2):
            out = str(tmp_path / "out" / f"{config}-seed{seed}")
            assert sum(1 for c in runs if Path(c[1]).stem == config and f"seed={seed}" in c and c[-2:] == ["--out", out]) == 1
            expected.append(out)
    assert report[0] == "report" and sorted(report[1:-2]) == sorted(expected) and report[-2:] == ["--out", str(tmp_path / "out" / "report")]


def test_parallel_runs_start_the_same_runs_and_report_after_them(tmp_path):
    script = ROOT / "experiments" / "fedepth_table2" / "compare.sh"
    one_by_one = calls_of(script, tmp_path, "--seeds", "0,1", "fl.rounds=1")
    (tmp_path / "calls.txt").unlink()
    at_once = calls_of(script, tmp_path, "--seeds", "0,1", "fl.rounds=1", env={"HFL_PARALLEL": "14", "FAKE_RUN_SECONDS": "0.5"})
    assert sorted(at_once[:-1]) == sorted(one_by_one[:-1]) and at_once[-1] == one_by_one[-1]
    assert (tmp_path / "out" / "fedepth-seed1.log").is_file()


def test_parallel_runs_stay_within_their_number_and_limit(tmp_path):
    script = ROOT / "experiments" / "fedepth_table2" / "compare.sh"
    calls_of(script, tmp_path, env={"HFL_PARALLEL": "3", "FAKE_RUN_SECONDS": "0.3"})
    running = list(itertools.accumulate(1 if e == "start" else -1 for e in (tmp_path / "events.txt").read_text().split()))
    assert len(running) == 14 and max(running) == 3  # the 7 runs, never more than 3 at once
    (tmp_path / "calls.txt").unlink()
    cut = calls_of(script, tmp_path, env={"HFL_PARALLEL": "7", "HFL_RUN_LIMIT": "1", "FAKE_RUN_SECONDS": "5"})
    assert [c[0] for c in cut] == ["report"]  # every run stopped before it finished


@pytest.mark.parametrize("parallel", [None, "2"])
def test_a_finished_run_is_kept_and_an_interrupted_one_resumed(tmp_path, parallel):
    out = tmp_path / "out"
    (out / "fedepth").mkdir(parents=True)
    (out / "fedepth" / "summary.json").write_text("{}")
    (out / "heterofl").mkdir()
    (out / "heterofl" / "checkpoint.pt").write_bytes(b"")
    calls = calls_of(ROOT / "experiments" / "fedepth_table2" / "compare.sh", tmp_path, "fl.rounds=1",
                     env={"HFL_PARALLEL": parallel} if parallel else None)
    assert not any(c[-1] == str(out / "fedepth") for c in calls[:-1])
    assert ["run", "--resume", str(out / "heterofl"), "fl.rounds=1"] in calls
    assert {str(out / "fedepth"), str(out / "heterofl")} <= set(calls[-1])


def test_parallel_must_be_a_number_of_runs(tmp_path):
    with pytest.raises(subprocess.CalledProcessError) as failed:
        calls_of(ROOT / "experiments" / "fedepth_table2" / "compare.sh", tmp_path, env={"HFL_PARALLEL": "yes"})
    assert failed.value.returncode == 2 and b"HFL_PARALLEL=yes" in failed.value.stderr


def test_one_seed_keeps_one_folder_per_method(tmp_path):
    calls = calls_of(ROOT / "experiments" / "scalefl_cifar10" / "compare.sh", tmp_path)
    assert [c[-1] for c in calls[:-1]] == [str(tmp_path / "out" / m) for m in
                                          ("fedavg", "decoupled", "heterofl", "fedrolex", "fjord", "depthfl", "scalefl", "feddf")]
    assert all("seed=0" in c for c in calls[:-1])


def test_nefl_comparison_omits_blocks_per_stage_on_the_resnet56_family(tmp_path):
    calls = calls_of(ROOT / "experiments" / "nefl_table1" / "compare.sh", tmp_path, "model.name=preresnet20")
    per_stage = {Path(c[1]).stem for c in calls if "method.omit=per_stage" in c}
    assert per_stage == {"nefl_d", "nefl_wd"}
    assert {Path(c[1]).stem for c in calls[:-1]} >= {"fjord", "fjord_ordered_dropout"}
    (tmp_path / "calls.txt").unlink()
    calls = calls_of(ROOT / "experiments" / "nefl_table1" / "compare.sh", tmp_path)
    assert not any("method.omit=per_stage" in c for c in calls)


def test_fedmef_comparison_gives_the_sparsity_to_the_pruning_methods_only(tmp_path):
    calls = calls_of(ROOT / "experiments" / "fedmef_table1" / "compare.sh", tmp_path, "method.sparsity=0.8", "fl.rounds=1",
                     "method.adjust_every=4", "method.stop_round=24")
    given = {Path(c[1]).stem for c in calls[:-1] if "method.sparsity=0.8" in c}
    assert given == {"flpqsu", "feddst", "fedtiny", "fedmef"}
    for override in ("method.adjust_every=4", "method.stop_round=24"):
        assert {Path(c[1]).stem for c in calls[:-1] if override in c} == {"feddst", "fedtiny", "fedmef"}
    assert all("fl.rounds=1" in c for c in calls[:-1])


def member_costs(out, methods, family=("lm_cpu", "gpt_l3", "gpt")):
    """Cost tables as `benchmarks/caff_member_costs.py` writes them (the scripts keep existing ones):
    every method's smallest level costs 50 MiB on l = 3 and 200 MiB on l = 12 (FedRolex's and HeteroFL's
    20 and 30), its largest 100 and 400 MiB; `family`: its name and the models of l = 3 and 12."""
    import json

    name, *models = family
    members = {str(d): [f"model.name={m}", f"model.pretrained={name}:{d}"] for d, m in zip((3, 12), models)}

    folder = out / "costs"
    folder.mkdir(parents=True)
    for method in methods:
        small = (20, 30) if method in ("fedrolex", "heterofl") else (50, 200)
        rows = [{"depth": d, "level": level, "peak_bytes": mib * 2**20, "train_flops_per_sample": 1, "upload_bytes": 1}
                for d, low, high in zip((3, 12), small, (100, 400)) for level, mib in (("small", low), ("large", high))]
        (folder / f"{method}.json").write_text(json.dumps({"rows": rows, "smallest": {"3": "small", "12": "small"}, "largest": {"3": "large", "12": "large"},
                                                           "max_samples": 10, "local_epochs": 1, "members": members}))


@pytest.mark.slow
def test_caff_table1_gives_each_baseline_the_deepest_member_its_smallest_level_fits(tmp_path):
    member_costs(tmp_path / "out", ("hetlora", "fedhm", "fedrolex"))
    calls = calls_of(ROOT / "experiments" / "caff_table1" / "compare.sh", tmp_path, "--seeds", "0,2", "kinds=memory", "levels=1", "fl.rounds=1")
    runs, report = calls[:-1], calls[-1]
    by_out = {Path(c[-1]).name: c for c in runs}
    assert sorted(by_out) == sorted(f"memory1-{m}-seed{s}" for m in ("caff", "hetlora", "fedhm", "fedrolex") for s in (0, 2))
    assert all("budgets.memory=[60MiB]" in c and "fl.rounds=1" in c for c in runs)
    assert "model.pretrained=lm_cpu:3" in by_out["memory1-hetlora-seed0"] and "model.name=gpt_l3" in by_out["memory1-fedhm-seed2"]
    assert "model.name=gpt" in by_out["memory1-fedrolex-seed0"] and "model.pretrained=lm_cpu:12" in by_out["memory1-fedrolex-seed0"]
    assert not any(a.startswith("model.") for a in by_out["memory1-caff-seed0"])  # CAFF picks its own member
    assert report[0] == "report" and len(report[1:-2]) == 8


@pytest.mark.slow
def test_caff_table1_with_members_all_runs_each_baseline_on_every_member_that_fits(tmp_path):
    """The paper's best of four: at 60 MiB FedRolex's smallest level fits l = 12 and l = 3 (20 and 30
    MiB), the others' only l = 3 (50 of 200 MiB); each fitting member is a run of its own."""
    member_costs(tmp_path / "out", ("hetlora", "fedhm", "fedrolex"))
    calls = calls_of(ROOT / "experiments" / "caff_table1" / "compare.sh", tmp_path, "kinds=memory", "levels=1", "members=all")
    by_out = {Path(c[-1]).name: c for c in calls[:-1]}
    assert sorted(by_out) == ["memory1-caff", "memory1-fedhm-l3", "memory1-fedrolex-l12", "memory1-fedrolex-l3", "memory1-hetlora-l3"]
    assert "model.pretrained=lm_cpu:12" in by_out["memory1-fedrolex-l12"] and "model.name=gpt_l3" in by_out["memory1-fedrolex-l3"]
    assert not any(a.startswith("members=") for c in calls for a in c)  # the script's own option, not an hfl override


def test_caff_table1_refuses_an_unknown_members_choice(tmp_path):
    member_costs(tmp_path / "out", ("hetlora", "fedhm", "fedrolex"))
    done = subprocess.run(["bash", str(ROOT / "experiments" / "caff_table1" / "compare.sh"), str(tmp_path / "out"), "members=best"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "members=best is not one of deepest, all" in done.stderr


@pytest.mark.slow
def test_caff_table2_gives_width_methods_the_member_a_strong_client_trains_whole(tmp_path):
    member_costs(tmp_path / "out", ("hetlora", "fedhm", "fedrolex", "heterofl", "fjord", "depthfl"))
    calls = calls_of(ROOT / "experiments" / "caff_table2" / "compare.sh", tmp_path, "kinds=memory")
    by_out = {Path(c[-1]).name: c for c in calls[:-1]}
    assert all("budgets.memory=[60MiB,110MiB]" in c for c in by_out.values())
    # HetLoRA's smallest level fits the low clients (60 MiB) on l = 3 only; a high client (110 MiB) trains HeteroFL's
    # l = 3 whole but not l = 12, although the low ones could train a slice of l = 12.
    assert "model.name=gpt_l3" in by_out["memory-hetlora"] and "model.name=gpt_l3" in by_out["memory-heterofl"]
    assert "model.name=gpt" in by_out["memory-fedrolex"]


@pytest.mark.slow
def test_caff_table2_gives_fedhm_the_member_a_strong_client_could_train_without_svd(tmp_path):
    """Appendix B: FedHM's member is the deepest whose dense model a high client (110 MiB) trains, here
    l = 12 (105 MiB), although its smallest factors fit the low clients (60 MiB) on l = 3 only."""
    import json

    member_costs(tmp_path / "out", ("hetlora", "fedhm", "fedrolex", "heterofl", "fjord", "depthfl"))
    costs = tmp_path / "out" / "costs" / "fedhm.json"
    table = json.loads(costs.read_text())
    for row in table["rows"]:
        row["peak_bytes"] = {(3, "small"): 50, (3, "large"): 100, (12, "small"): 200, (12, "large"): 105}[row["depth"], row["level"]] * 2**20
    costs.write_text(json.dumps(table))
    calls = calls_of(ROOT / "experiments" / "caff_table2" / "compare.sh", tmp_path, "kinds=memory")
    fedhm = next(c for c in calls[:-1] if Path(c[-1]).name == "memory-fedhm")
    assert "model.name=gpt" in fedhm and "model.pretrained=lm_cpu:12" in fedhm
    assert not any("train_dense" in a for a in fedhm)  # chosen by the dense model, trained as factors


@pytest.mark.slow
def test_caff_table1_on_cifar10_runs_the_vit_configs_at_the_vit_familys_amounts(tmp_path):
    member_costs(tmp_path / "out", ("hetlora", "fedhm", "fedrolex"), ("vit_cpu", "vit_caff_l3", "vit_caff_l12"))
    calls = calls_of(ROOT / "experiments" / "caff_table1" / "compare.sh", tmp_path, "task=cifar10", "kinds=memory", "levels=3")
    by_out = {Path(c[-1]).name: c for c in calls[:-1]}
    assert sorted(by_out) == sorted(f"memory3-{m}" for m in ("caff", "hetlora", "fedhm", "fedrolex"))
    assert all(Path(c[1]).parent.name == "cifar10" and "budgets.memory=[215MiB]" in c and "task=cifar10" not in c for c in by_out.values())
    assert "model.name=vit_caff_l12" in by_out["memory3-hetlora"] and "model.pretrained=vit_cpu:12" in by_out["memory3-fedrolex"]


@pytest.mark.slow
def test_caff_table2_on_cifar10_runs_the_vit_configs(tmp_path):
    member_costs(tmp_path / "out", ("hetlora", "fedhm", "fedrolex", "heterofl", "fjord", "depthfl"), ("vit_cpu", "vit_caff_l3", "vit_caff_l12"))
    calls = calls_of(ROOT / "experiments" / "caff_table2" / "compare.sh", tmp_path, "task=cifar10", "kinds=memory")
    by_out = {Path(c[-1]).name: c for c in calls[:-1]}
    assert len(by_out) == 7 and all(Path(c[1]).parent.name == "cifar10" for c in by_out.values())
    assert "model.pretrained=vit_cpu:3" in by_out["memory-heterofl"]


@pytest.mark.parametrize("table", ["caff_table1", "caff_table2"])
def test_caff_grids_refuse_an_unknown_task(table, tmp_path):
    result = subprocess.run(["bash", str(ROOT / "experiments" / table / "compare.sh"), str(tmp_path / "out"), "task=cifar100"],
                            check=False, capture_output=True, text=True)
    assert result.returncode == 2 and "task=cifar100" in result.stderr and "shakespeare, cifar10" in result.stderr


@pytest.mark.parametrize(("model", "family", "deepest"), [("gpt_l3", "lm_cpu", "gpt"), ("vit_caff_l6", "vit_cpu", "vit_caff_l12")])
def test_member_costs_run_every_member_of_the_configs_family(model, family, deepest):
    import importlib.util

    spec = importlib.util.spec_from_file_location("caff_member_costs", ROOT / "benchmarks" / "caff_member_costs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    members = module.member_overrides(model, f"{family}:3")
    assert sorted(members) == [3, 6, 9, 12]
    assert members[12] == [f"model.name={deepest}", f"model.pretrained={family}:12"]
    assert members[6][1] == f"model.pretrained={family}:6"
    for name, pretrained in (("cnn", f"{family}:3"), (model, "")):
        with pytest.raises(SystemExit, match="names no pretrained family member"):
            module.member_overrides(name, pretrained)


def test_a_per_batch_flops_budget_bounds_one_full_batch_not_the_largest_clients_round():
    """CAFF's unit (appendix A): GFLOPs of one mini-batch. Per round, the client with the most
    samples (1,000 here, 2 epochs) would rule out both members; per batch of 32 the deeper member
    fits exactly at 40 × 32."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("caff_member_costs", ROOT / "benchmarks" / "caff_member_costs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [{"depth": d, "level": "small", "peak_bytes": 1, "upload_bytes": 1, "train_flops_per_sample": f} for d, f in ((3, 10), (12, 40))]
    costs = {"rows": rows, "smallest": {"3": "small", "12": "small"}, "max_samples": 1000, "local_epochs": 2, "batch_size": 32}
    assert module.fitting_members({**costs, "flops_per": "round"}, 10, 10, 40 * 32) == []
    assert module.fitting_members({**costs, "flops_per": "round"}, 10, 10, 10 * 2000) == [3]
    assert module.fitting_members({**costs, "flops_per": "batch"}, 10, 10, 40 * 32) == [12, 3]
    assert module.fitting_members({**costs, "flops_per": "batch"}, 10, 10, 40 * 32 - 1) == [3]


@pytest.mark.slow
def test_caff_table1_with_random_init_adds_caff_on_fresh_blocks_beside_each_column(tmp_path):
    member_costs(tmp_path / "out", ("hetlora", "fedhm", "fedrolex"))
    calls = calls_of(ROOT / "experiments" / "caff_table1" / "compare.sh", tmp_path, "kinds=memory", "levels=1,3", "random_init=yes")
    by_out = {Path(c[-1]).name: c for c in calls[:-1]}
    assert {"memory1-caff_random", "memory3-caff_random", "memory1-caff", "memory3-caff"} <= set(by_out)
    assert "model.pretrained=''" in by_out["memory3-caff_random"] and "budgets.memory=[110MiB]" in by_out["memory3-caff_random"]
    assert not any(a.startswith("model.") for a in by_out["memory3-caff"])
    (tmp_path / "plain").mkdir()
    member_costs(tmp_path / "plain" / "out", ("hetlora", "fedhm", "fedrolex"))
    plain = calls_of(ROOT / "experiments" / "caff_table1" / "compare.sh", tmp_path / "plain", "kinds=memory", "levels=1")
    assert not any("caff_random" in c[-1] for c in plain[:-1])


@pytest.mark.slow
def test_caff_grids_bound_flops_per_mini_batch_as_the_paper_counts_them(tmp_path):
    """Appendix A: "GFLOPs required for a single mini-batch"; every config of the grids says so, and
    the Shakespeare amounts are per batch of 32 (5 GFLOPs: F_3^2 fits, F_6^1 does not)."""
    import yaml

    for path in sorted((ROOT / "experiments").glob("caff_table*/**/*.yaml")):
        assert yaml.safe_load(path.read_text())["budgets"]["flops_per"] == "batch", path
    member_costs(tmp_path / "out", ("hetlora", "fedhm", "fedrolex"))
    calls = calls_of(ROOT / "experiments" / "caff_table1" / "compare.sh", tmp_path, "kinds=flops", "levels=1")
    assert all("budgets.flops=[5e9]" in c for c in calls[:-1])


@pytest.mark.parametrize("table, methods, expected", [
    ("caff_table1", "fedhm", ["memory1-fedhm"]),
    ("caff_table1", "caff,fedrolex", ["memory1-caff", "memory1-fedrolex"]),
    ("caff_table2", "caff,depthfl", ["memory-caff", "memory-depthfl"]),
])
def test_caff_grids_run_only_the_methods_named(tmp_path, table, methods, expected):
    member_costs(tmp_path / "out", ("hetlora", "fedhm", "fedrolex", "heterofl", "fjord", "depthfl"))
    levels = ["levels=1"] if table == "caff_table1" else []
    calls = calls_of(ROOT / "experiments" / table / "compare.sh", tmp_path, "kinds=memory", *levels, f"methods={methods}")
    assert sorted(Path(c[-1]).name for c in calls[:-1]) == expected
    assert not any(a.startswith("methods=") for c in calls for a in c)


def test_caff_grids_refuse_a_method_they_do_not_run(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "experiments" / "caff_table1" / "compare.sh"), str(tmp_path / "out"), "methods=caff,heterofl"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "methods=heterofl is not one of caff hetlora fedhm fedrolex" in done.stderr
