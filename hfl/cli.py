"""The `hfl` command: run experiments, inspect data partitions, list methods.

User-facing output lives here; bad input exits with code 2 and one line, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

USAGE_ERROR = 2
INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""
# Fields that may change between a run and its resumption: they do not change what is computed.
RESUMABLE_CHANGES = ("fl.rounds", "fl.time_limit_s", "fl.eval_mode", "fl.eval_spill_dir", "data.root", "data.cache_dir", "logging.", "backend.device", "backend.trainer",
                     # the backend itself (local and Ray compute the same numbers: a run whose cluster
                     # is gone can finish on one machine), where and how Ray places the clients, and how
                     # long it waits for the cluster: a cluster that lost a node may need other values
                     # to go on with the same run
                     "backend.name", "backend.head_grace_s", "backend.actor_start_timeout_s", "backend.num_cpus_per_client", "backend.actors_per_pool", "backend.num_gpus_per_client",
                     "backend.num_gpus_per_tier", "backend.gpu_memory", "backend.tier_strict", "backend.ray_log_to_driver")


class RoundProgress:
    """A progress bar over rounds on a terminal, one line per round otherwise (CI logs, files)."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.interactive = total, sys.stderr.isatty()
        if self.interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="round", dynamic_ncols=True)

    def on_round(self, record: dict[str, Any]) -> None:
        acc = record["accuracy"]
        text = f"acc={acc:.4f}" if acc is not None else "acc=n/a"
        if record.get("perplexity") is not None:
            text += f" ppl={record['perplexity']:.3f}"
        if record.get("sim_end_s") is not None:  # with devices: the simulated clock at the round's end (docs/time.md)
            text += f" sim={record['sim_end_s']:.1f}s"
        if self.interactive:
            self.bar.set_postfix_str(text)
            self.bar.update(1)
        else:
            print(f"round {record['round']}/{self.total}  {text}  {record['wall_seconds']:.2f}s", file=sys.stderr, flush=True)

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.interactive:
            self.bar.close()


class PretrainProgress:
    """`hfl pretrain`'s display: a bar per member showing tokens (or images) per second and the
    loss on a terminal, a line every 5 % of the steps otherwise."""

    def __init__(self) -> None:
        self.interactive = sys.stderr.isatty()
        self.bar: Any = None

    def on_member_start(self, depth: int, steps: int, done: int, config: Any) -> None:
        self.depth, self.steps, self.per_step = depth, steps, config.units_per_step
        self.unit = "tok" if config.unit == "token" else "img"
        self.started, self.first, self.shown = time.perf_counter(), done, 0.0
        self.every = max(1, steps // 20)
        resumed = f", resuming at step {done}" if done else ""
        print(f"l{depth}: {steps} steps of {self.per_step} {config.unit}s{resumed}", file=sys.stderr, flush=True)
        if self.interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=steps * self.per_step, initial=done * self.per_step, unit=self.unit, unit_scale=True,
                            dynamic_ncols=True, desc=f"l{depth}")

    def on_step(self, info: Any) -> None:
        if self.interactive:
            self.bar.update(self.per_step)
            now = time.perf_counter()
            if now - self.shown > 0.5 or info.step == info.steps:  # .item() waits for the device: not every step
                self.shown = now
                self.bar.set_postfix_str(f"loss={info.loss.item():.3f}")
        elif info.step % self.every == 0 or info.step == info.steps:
            rate = (info.step - self.first) * self.per_step / max(time.perf_counter() - self.started, 1e-9)
            print(f"l{info.depth} step {info.step}/{info.steps}  loss {info.loss.item():.4f}  {rate:,.0f} {self.unit}/s",
                  file=sys.stderr, flush=True)

    def on_member_end(self, card: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def config_changes(config: Any, saved: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted field -> (saved value, value in `config`) for every field where they differ."""
    import dataclasses

    import yaml

    from hfl.config import flatten

    # Both sides go through YAML so that tuples and lists compare equal.
    now, before = flatten(yaml.safe_load(yaml.safe_dump(config.to_dict()))), flatten(saved)
    # A field added to hfl after the run was written is absent there: at its default it changes nothing.
    # So is a field of another method than the saved run's, at its default: method.name names the change.
    defaults = flatten(yaml.safe_load(yaml.safe_dump({**type(config)().to_dict(), "method": dataclasses.asdict(type(config.method)())})))
    return {
        k: (before.get(k), now.get(k)) for k in sorted(set(now) | set(before))
        if now.get(k) != before.get(k) and not (k not in before and k in defaults and now[k] == defaults[k])
    }


def check_resumable(config: Any, saved: dict[str, Any], out: Path) -> None:
    """Refuse to resume `out` with a config that changes what is computed."""
    from hfl.errors import ConfigError

    changed = {k: v for k, v in config_changes(config, saved).items() if not k.startswith(RESUMABLE_CHANGES)}
    if changed:
        shown = ", ".join(f"{k}: {before!r} -> {now!r}" for k, (before, now) in changed.items())
        raise ConfigError("--resume", str(out), f"the same config as the run being resumed (differs in {shown})")


def resumed_config(out: Path, config_path: str | None, overrides: list[str]) -> Any:
    """The config a resumed run continues with: the run's own `config.yaml` with the explicit
    overrides (of the fields a resumption may change). A config file given beside it must describe
    the same experiment; its values of those fields are not taken (it may say 20 rounds where the
    run was started with fl.rounds=6)."""
    import copy

    from hfl.checkpoint import has_checkpoint
    from hfl.config import (
        apply_overrides,
        config_from_dict,
        load_config,
        read_yaml_mapping,
    )
    from hfl.errors import ConfigError

    if not has_checkpoint(out):
        raise ConfigError("--resume", str(out), "a run folder with a checkpoint.pt (none found there)")
    saved = read_yaml_mapping(out / "config.yaml", "--resume", "the run's config.yaml")
    config = config_from_dict(apply_overrides(copy.deepcopy(saved), overrides))
    check_resumable(config, saved, out)
    if config_path is not None:
        given = load_config(config_path, overrides)
        check_resumable(given, saved, out)
        ignored = [f"{k}={now!r}" for k, (_, now) in config_changes(given, saved).items() if k not in config_changes(config, saved)]
        if ignored:
            print(f"hfl: resuming {out} with its own config; {config_path}'s {', '.join(ignored)} not taken "
                  f"(give such a change as an override, e.g. fl.rounds=N)", file=sys.stderr)
    return config


def command_run(args: argparse.Namespace) -> int:
    from hfl.backends.base import ClusterError
    from hfl.checkpoint import has_checkpoint
    from hfl.config import load_config
    from hfl.errors import ConfigError
    from hfl.loggers import read_metrics
    from hfl.server import run_experiment
    from hfl.storage import check_job_location, staged

    config_path, overrides = args.config, list(args.overrides)
    if config_path is not None and "=" in config_path and not Path(config_path).exists():  # `hfl run --resume DIR k=v`
        config_path, overrides = None, [config_path, *overrides]
    if args.resume:
        out = args.resume
        with staged(out, "--resume") as (folder, _):  # a URI's run is read from a copy
            config = resumed_config(folder, config_path, overrides)
            done = len(read_metrics(folder))
    else:
        if config_path is None:
            raise ConfigError("config", None, "an experiment YAML file, e.g. experiments/quickstart.yaml (or --resume DIR to continue a run)")
        config = load_config(config_path, overrides)
        check_job_location(args.out, "--out")  # before the default below, which is relative
        out = args.out or f"runs/{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if "://" not in out and has_checkpoint(Path(out)):
            raise ConfigError("--out", out, f"a folder without a run in it (continue this one with: hfl run --resume {out}; "
                              "or remove it, or choose another folder)")
        done = 0
    rounds = f"{config.fl.rounds} round{'s' * (config.fl.rounds != 1)}"
    rounds += f" or {config.fl.time_limit_s:g} simulated s, whichever ends first" if config.fl.time_limit_s else ""
    print(f"hfl: {config.method.name} on {config.data.name}, {config.fl.clients} clients, {rounds} -> {out}", file=sys.stderr)
    try:
        summary = run_experiment(config, out, resume=bool(args.resume), callbacks=[RoundProgress(config.fl.rounds, done)])
    except KeyboardInterrupt:
        print(f"hfl: interrupted; continue with: hfl run --resume {out}", file=sys.stderr)
        return INTERRUPTED
    except ClusterError as error:
        print(f"hfl: error: {error}; continue with: hfl run --resume {out}", file=sys.stderr)
        return 1
    rows = [(k, summary_cell(k, v)) for k, v in summary.items() if v is not None and not isinstance(v, dict)]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if summary.get("tiers"):
        print("\nper budget tier (memory in MiB)")
        print(table(["tier", "client-rounds", "budget", "mean peak", "violations", "mean GFLOPs", "mean up"],
                    [[name, t["client_rounds"], mib(t["budget_bytes"]), mib(t["mean_estimated_peak_bytes"]), t["budget_violations"],
                      f"{t['mean_flops'] / 1e9:.2f}", mib(t["mean_bytes_up"])] for name, t in summary["tiers"].items()]))
    print(f"results: {out}/metrics.jsonl, {out}/summary.json")
    return 0


BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
FLOP_UNITS = (("PFLOPs", 1e15), ("TFLOPs", 1e12), ("GFLOPs", 1e9), ("MFLOPs", 1e6), ("kFLOPs", 1e3))


def human_bytes(n: float) -> str:
    """A byte count in binary units: 512 B, 1.50 KiB, 3.25 MiB, 2.00 GiB."""
    for unit, size in BYTE_UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def human_flops(n: float) -> str:
    """A FLOP count with an SI prefix: 950 FLOPs, 4.06 GFLOPs, 1.20 TFLOPs."""
    for unit, size in FLOP_UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} FLOPs"


def summary_cell(key: str, value: Any) -> str:
    """A value of a run's summary as printed: bytes and FLOPs in human units, other floats to 4 places.
    Quantities are named by their unit (total_bytes_up, max_estimated_peak_bytes, total_flops);
    counts of events by the event (flops_violations)."""
    words = key.split("_")
    if "bytes" in words:
        return human_bytes(value)
    if words[-1] == "flops":
        return human_flops(value)
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def command_pretrain(args: argparse.Namespace) -> int:
    from hfl.models.family import family_dir, format_duration
    from hfl.pretrain import estimate_cpu_seconds, load_pretrain_config, pretrain

    config = load_pretrain_config(args.config, args.overrides)
    estimate = estimate_cpu_seconds(config)
    about = f", about {format_duration(estimate)} on a 2-core CPU" if estimate else ""
    print(f"hfl: pretraining {config.model} family {config.family} (l = {', '.join(map(str, config.depths))}) on {config.corpus}, "
          f"{config.budget:,} {config.unit}s each{about} -> {family_dir(config.cache_dir, config.family)}", file=sys.stderr)
    cards = pretrain(config, PretrainProgress())
    print(table(["member", "params", f"{config.unit}s seen", "train loss", "val loss", "wall s"],
                [[f"{c['family']}:{c['depth']}", f"{c['parameters']:,}", f"{c['steps'] * config.units_per_step:,}",
                  f"{c['final_train_loss']:.4f}", f"{c['final_val_loss']:.4f}", f"{c['wall_seconds']:.1f}"] for c in cards]))
    print(f"weights and cards: {family_dir(config.cache_dir, config.family)}; load one with model.pretrained={config.family}:L")
    return 0


def command_data(args: argparse.Namespace) -> int:
    from hfl.config import load_config
    from hfl.data import TokenDataset, label_histogram, save_label_heatmap
    from hfl.experiment import ClientEnvironment

    config = load_config(args.config, args.overrides)
    env = ClientEnvironment.from_config(config)
    if isinstance(env.data, TokenDataset):
        print_text_clients(config, env.data)
        if args.png:
            print(f"hfl: no heat map written to {args.png}: {config.data.name}'s samples are token windows, without labels", file=sys.stderr)
        return 0
    parts = [p.numpy() for p in env.partitions]
    hist = label_histogram(env.data.train_y.numpy(), parts, env.data.num_classes)
    d = config.data
    setting = partition_setting(d)
    print(f"{d.name}: {len(env.data.train_y)} train / {len(env.data.test_y)} test, partition {d.partition}{setting}, {config.fl.clients} clients")
    cell = max(5, len(str(int(hist.max()))) + 1)
    print("client" + "".join(f"{c:>{cell}}" for c in range(hist.shape[1])) + f"{'total':>8}")
    for i, row in enumerate(hist):
        print(f"{i:>6}" + "".join(f"{int(v):>{cell}}" for v in row) + f"{int(row.sum()):>8}")
    sizes = hist.sum(1)
    print(f"samples per client: min {sizes.min()}, mean {sizes.mean():.1f}, max {sizes.max()}; "
          f"labels per client: mean {np.mean((hist > 0).sum(1)):.1f}")
    if args.png:
        save_label_heatmap(hist, args.png, title=f"{d.name} {d.partition}{setting}, {config.fl.clients} clients")
        print(f"heat map: {args.png}")
    return 0


def partition_setting(data: Any) -> str:
    """The partition's own parameter, as ` (alpha=0.5)` or ` (labels_per_client=2)`; '' for one without."""
    if "dirichlet" in data.partition:
        return f" (alpha={data.alpha:g})"
    return f" (labels_per_client={data.labels_per_client})" if data.partition == "pathological" else ""


def print_text_clients(config: Any, data: Any) -> None:
    """`hfl data` for a text dataset with its own clients: each client's name and windows."""
    train, test = data.sizes("train"), data.sizes("test")
    print(f"{data.name}: {train.sum()} train / {test.sum()} test windows of {data.seq_len} tokens (targets: the next token at "
          f"every position), partition {config.data.partition}, {len(data.clients)} clients")
    print(table(["client", "name", "train", "test"], [[i, name, int(a), int(b)] for i, (name, a, b) in enumerate(zip(data.clients, train, test))]))
    print(f"samples per client: min {train.min()}, mean {train.mean():.1f}, max {train.max()}; "
          f"test windows per client: min {test.min()}, mean {test.mean():.1f}, max {test.max()}")


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


LEVEL_HEADERS = {"name": "sub-model", "params": "#params", "flops": "#FLOPs", "peak_bytes": "train memory MiB", "depth": "blocks",
                 "params_ratio": "params ratio", "omitted_blocks": "omitted blocks",
                 "upload_bytes": "upload MiB"}


def level_cell(key: str, value: Any) -> str:
    """One cell of a method's level table: counts in millions, bytes in MiB, ratios to 3 places."""
    if value is None:
        return "-"
    if key in ("params", "flops") or key.endswith("flops_per_sample"):
        return f"{value / 1e6:.3f} M"
    if key.endswith("bytes"):
        return mib(value)
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def command_budget(args: argparse.Namespace) -> int:
    import json

    from hfl.budget import budget_report
    from hfl.config import load_config
    from hfl.experiment import ClientEnvironment

    config = load_config(args.config, args.overrides)
    report = budget_report(config, ClientEnvironment.from_config(config))
    shape = "x".join(map(str, report["input_shape"])) + (" token ids" if report["input_kind"] == "tokens" else "")
    print(f"{report['model']} (width {report['model_width']:g}) on {report['dataset']} {shape}, batch {report['batch_size']}, "
          f"optimizer {report['optimizer']}; memory in MiB\n")
    print("Training one block (FeDepth's unit: that block and the head trained, the other blocks frozen)")
    print(table(["block", "channels", "params", "activations", "block alone", "peak with model resident"],
                [[b["block"], b["channels"], mib(b["param_bytes"]), mib(b["activation_bytes"]), mib(b["block_training_bytes"]), mib(b["peak_bytes"])]
                 for b in report["blocks"]]))
    print("\nTraining the whole model by width")
    print(table(["width", "params", "activations", "peak", "train FLOPs/sample"],
                [[f"x{w['width']}", mib(w["param_bytes"]), mib(w["activation_bytes"]), mib(w["peak_bytes"]), human_flops(w["train_flops_per_sample"])]
                 for w in report["widths"]]))
    if report["tiers"]:
        print(f"\nBudget tiers ({report['scenario']})")
        print(table(["tier", "clients", "memory", "memory MiB", "upload MiB", "flops"],
                    [[t["tier"], t["clients"], t["memory"], mib(t["memory_bytes"]), mib(t["upload_bytes"]), t["flops"] or "-"] for t in report["tiers"]]))
    if report["plans"]:
        print(f"\nWhat a client of each tier trains ({config.method.name}, round 1)")
        timed = any("round_s" in p for p in report["plans"])  # with devices: simulated seconds on the tier's first client's device
        print(table(["tier", "budget", "estimated peak", "trains", *(["client", "down s", "compute s", "up s", "round s"] if timed else [])],
                    [[p["tier"], mib(p["budget_bytes"]), mib(p["peak_bytes"]), p["plan"],
                      *([p.get("client", "-"), *(f"{p[k]:.3g}" if k in p else "-" for k in ("down_s", "compute_s", "up_s", "round_s"))] if timed else [])]
                     for p in report["plans"]]))
    if any("level_round_s" in p for p in report["plans"]):
        levels = list(next(p["level_round_s"] for p in report["plans"] if "level_round_s" in p))
        print("\nRound seconds of each sub-model on each tier's device (round 1, the tier's first client; what fl.deadline_plans chooses among)")
        print(table(["tier", *levels], [[p["tier"], *(f"{p['level_round_s'][k]:.3g}" for k in levels)] for p in report["plans"] if "level_round_s" in p]))
    if report.get("levels"):
        title = f"{report['levels_title']}; " if report.get("levels_title") else ""
        print(f"\nSub-models of {config.method.name} ({title}FLOPs: forward, per sample; memory: training)")
        first = report["levels"][0]
        named = [] if {"level", "submodel"} & first.keys() else ["name"]  # a numbered level (ScaleFL's, NeFL's) is its own name
        columns = [*named, *(k for k in first if k not in ("name", "cost"))]
        print(table([LEVEL_HEADERS.get(k, k) for k in columns],
                    [[level_cell(k, lv.get(k)) for k in columns] for lv in report["levels"]]))
    if report.get("sparse"):
        print("\nSparse training, FedMef's Table 1 / Table 5 form (one client of the mean partition, one adjustment round; "
              "memory in MiB, the paper's estimate 2M_p + 2M_a (+ M_xi), FedMef's 2M_p + M_a(SAP) + M_a(dense) + M_xi)")
        print(table(["method", "sparsity", "params", "activations", "peak (measured)", "peak, sparse weights", "paper's estimate", "train GFLOPs",
                     "x FedAvg", "down+up", "x FedAvg"],
                    [[r["method"], f"{r['sparsity']:g}", mib(r["param_bytes"]), mib(r["activation_bytes"]), mib(r["peak_bytes"]), mib(r["sparse_peak_bytes"]),
                      mib(r["paper_memory_bytes"]), f"{r['train_flops'] / 1e9:.1f}", f"{r['flops_ratio']:.3f}",
                      mib(r["bytes_down"] + r["bytes_up"]), f"{r['exchange_ratio']:.3f}"] for r in report["sparse"]]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\njson: {args.json}")
    return 0


def command_tune(args: argparse.Namespace) -> int:
    from hfl.tune import format_results, run_tune, show_progress

    show_progress()  # a line per trial and round while the sweep runs
    outcome = run_tune(args.space, args.overrides, out=args.out, resume=args.resume)
    print(format_results(outcome))
    if outcome.interrupted:  # Tune took the Ctrl-C and saved its state; exit as `hfl run` does
        print(f"hfl: interrupted; continue with: hfl tune {args.space} --out {outcome.out} --resume", file=sys.stderr)
        return INTERRUPTED
    return 1 if outcome.incomplete else 0


def command_report(args: argparse.Namespace) -> int:
    from hfl.report import write_report

    report = write_report(args.runs, args.out)
    print(report.read_text().split("\n![")[0].rstrip())
    print(f"\nreport: {report}  plots: {report.parent}/accuracy_by_round.png, {report.parent}/accuracy_by_memory.png")
    return 0


def command_config(args: argparse.Namespace) -> int:
    from hfl.config import load_config
    from hfl.config_docs import describe

    config = load_config(args.config, args.overrides)
    print(f"# {args.config}{''.join(f' {o}' for o in args.overrides)}, resolved: every field, under its documentation")
    print("\n".join(describe(config)))
    return 0


def method_info(name: str) -> dict[str, str]:
    """A method's one-line summary and paper, from its declaration or else its module's docstring."""
    from hfl.registry import METHODS

    info = METHODS.info(name)
    if not info:  # registered by a user's module rather than declared: its docstring speaks for it
        doc = sys.modules[METHODS.get(name).__module__].__doc__ or "(no description)"
        info = {"summary": doc.strip().splitlines()[0], "paper": "-"}
    return info


def print_method(name: str) -> None:
    """`hfl methods NAME`: the method's paper and its fields, as the `method:` section of an experiment."""
    from hfl.config_docs import describe
    from hfl.registry import METHODS

    config = METHODS.get(name, field="method").Config()
    info = method_info(name)
    print(f"{name}: {info['summary']}\npaper: {info['paper']}\n")
    print("# Its fields with their defaults, as an experiment's method section (override one with method.FIELD=VALUE)")
    print("\n".join(["method:", *describe(config, "  ", allowed=True)]))


def command_methods(args: argparse.Namespace) -> int:
    import hfl.methods  # noqa: F401  (declares the methods without importing them)
    from hfl.registry import METHODS

    if args.name:
        print_method(args.name)
        return 0
    rows = []
    for name in METHODS:
        info = method_info(name)
        rows.append((name, info["summary"], info["paper"]))
    width = max(len(r[0]) for r in rows)
    for name, summary, paper in rows:
        print(f"{name:<{width}}  {summary}\n{'':<{width}}  paper: {paper}")
    print("\nhfl methods NAME: a method's fields, defaults and allowed values")
    return 0


def installed_version() -> str:
    """hfl's version, from the package metadata that installing it wrote."""
    try:
        return importlib.metadata.version("hfl")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
        return "(not installed: pip install -e .)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hfl", description="Federated learning with heterogeneous, resource-constrained clients.")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    p.add_argument("--version", action="version", version=f"hfl {installed_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment: hfl run CONFIG [key=value ...] [--out DIR]; hfl run --resume DIR [key=value ...]")
    run.add_argument("config", nargs="?", help="experiment YAML, e.g. experiments/quickstart.yaml (not needed with --resume)")
    run.add_argument("overrides", nargs="*", help="dotted overrides such as fl.rounds=3 data.alpha=0.3")
    run.add_argument("--out", help="output folder (default runs/NAME-TIMESTAMP)")
    run.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint, with the config saved there "
                     "(overrides may change fl.rounds, fl.time_limit_s, fl.eval_mode, paths, logging and the backend)")
    run.set_defaults(func=command_run)
    pre = sub.add_parser("pretrain", help="pretrain a family of tiny transformers: hfl pretrain CONFIG [key=value ...] "
                         "(run it again to resume)")
    pre.add_argument("config", help="pretraining YAML, e.g. experiments/pretrain/lm_cpu.yaml")
    pre.add_argument("overrides", nargs="*", help="dotted overrides such as budget=100000 depths=[3]")
    pre.set_defaults(func=command_pretrain)
    data = sub.add_parser("data", help="print the per-client label histogram of a config's partition")
    data.add_argument("config")
    data.add_argument("overrides", nargs="*")
    data.add_argument("--png", help="also write the histogram as a PNG heat map")
    data.set_defaults(func=command_data)
    budget = sub.add_parser("budget", help="print training memory per block and per width, and the budget tiers")
    budget.add_argument("config")
    budget.add_argument("overrides", nargs="*")
    budget.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    budget.set_defaults(func=command_budget)
    tune = sub.add_parser("tune", help="run a Ray Tune sweep: hfl tune TUNE_SPACE.yaml [key=value ...] [--out DIR] [--resume]")
    tune.add_argument("space", help="sweep file, e.g. tune_spaces/quickstart.yaml")
    tune.add_argument("overrides", nargs="*", help="overrides of the base experiment, e.g. fl.rounds=3")
    tune.add_argument("--out", help="sweep folder or URI (s3://, gs://, file://; default runs/tune-NAME-TIMESTAMP, refused under "
                      "`ray job submit`); with --resume, the sweep to continue")
    tune.add_argument("--resume", action="store_true", help="continue the interrupted sweep in --out")
    tune.set_defaults(func=command_tune)
    report = sub.add_parser("report", help="compare finished runs: a Markdown table and PNG plots")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR")
    report.add_argument("--out", default="report", help="folder for report.md and the plots (default ./report)")
    report.set_defaults(func=command_report)
    methods = sub.add_parser("methods", help="list registered methods with their papers; hfl methods NAME: a method's fields")
    methods.add_argument("name", nargs="?", help="a method, e.g. heterofl: its paper and its fields with defaults and allowed values")
    methods.set_defaults(func=command_methods)
    config = sub.add_parser("config", help="print the resolved config, every field under its documentation: "
                            "hfl config CONFIG [key=value ...]")
    config.add_argument("config", help="experiment YAML, e.g. experiments/quickstart.yaml")
    config.add_argument("overrides", nargs="*", help="dotted overrides such as method.name=heterofl")
    config.set_defaults(func=command_config)
    return p


def is_override(arg: str) -> bool:
    """Whether a command-line word is a key=value override (an option such as --out=DIR is not)."""
    return "=" in arg and not arg.startswith("-")


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments. argparse hands a command its positional arguments once, before
    its first option, so the overrides of `hfl run CONFIG --out DIR fl.rounds=3` would come back
    unrecognised: every key=value left over joins the command's overrides, in the order written."""
    command_line = parser()
    args, unknown = command_line.parse_known_args(argv)
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *filter(is_override, unknown)]
        unknown = [arg for arg in unknown if not is_override(arg)]
    if unknown:
        command_line.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from hfl.errors import ConfigError, DataNotFoundError

    try:
        return args.func(args)
    except (ConfigError, DataNotFoundError) as error:
        print(f"hfl: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except OSError as error:  # a path given on the command line that cannot be read or written
        if args.verbose:
            traceback.print_exc()
        where = f"{error.filename}: {error.strerror}" if error.filename is not None else str(error)
        print(f"hfl: error: {where}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:  # an interrupted `hfl run` names its run folder itself (command_run)
        if args.command == "tune":
            print(f"hfl: interrupted; continue with: hfl tune {args.space} --out {args.out or 'OUT'} --resume", file=sys.stderr)
        elif args.command == "pretrain":
            print("hfl: interrupted; continue with: the same hfl pretrain command", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
