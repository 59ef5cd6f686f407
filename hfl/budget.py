"""The numbers behind `hfl budget`: per-block and per-width training memory, the tiers' budgets,
the levels a method defines (ScaleFL's split ratios, NeFL's sub-models, with their costs), and for
the sparse-training methods FedMef's Table 1 / Table 5 form (`sparse_rows`)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import torch
from torch import nn

from hfl.accounting.amounts import parse_width
from hfl.accounting.budgets import assign_budgets
from hfl.accounting.cost import OPTIMIZER_STATE_COPIES, sparse_weight_saving
from hfl.accounting.flops import FlopCounterMode
from hfl.config import ExperimentConfig, build_dataclass
from hfl.experiment import ClientEnvironment, accountant_for, build_model_for, train_settings
from hfl.methods.base import Method
from hfl.methods.fedtiny import Adjustment
from hfl.methods.sparse import AdjustedSparseConfig, SparseStart
from hfl.pruning.masks import prunable_keys
from hfl.registry import METHODS
from hfl.types import ClientTask, RoundContext

REPORT_WIDTHS = ("1/8", "1/6", "1/4", "1/3", "1/2", "1")
SPARSITIES = (0.8, 0.9, 0.95)
"""FedMef's Table 1 columns."""
SPARSE_TABLE_METHODS = ("fedavg", "flpqsu", "feddst", "fedtiny", "fedtiny, no norms", "fedmef", "fedmef, no SAP")
"""The rows of the sparse table: the methods as configured (their own norms: batch norm but for
FedMef's norm-free NSConv model), FedTiny on FedMef's norm-free model (so FedMef's saving over it is
SAP's, not the removed norms'), and FedMef's model without SAP."""


def describe_task(task: ClientTask) -> str:
    """One line on what a client trains, for `hfl budget`'s per-tier plans."""
    options = task.options
    if options is None:
        whole = not task.spec.indices and not task.spec.absent
        return "the whole model" if whole else str(task.spec.describe())
    text = str(options) if "__str__" in type(options).__dict__ else ", ".join(f"{k}={v}" for k, v in vars(options).items())
    if len(task.choices) > 1:
        text += f", drawn among {', '.join(task.choices)}"
    return text


def round_one(config: ExperimentConfig, env: ClientEnvironment, client: int, round_: int = 1) -> RoundContext:
    fl = config.fl
    settings = train_settings(fl, 1)
    return RoundContext(round_, client, config.seed, len(env.partitions[client]), settings, env.budgets[client])


def tier_plans(config: ExperimentConfig, env: ClientEnvironment) -> list[dict[str, Any]]:
    """What the method asks of the first client of each tier in round 1, with its estimated peak and,
    with devices, the simulated seconds it would take on that client's device, and those each of the
    method's sub-models (ladder levels) would take there (docs/time.md)."""
    from hfl.simulation.devices import assign_devices
    from hfl.simulation.estimate import expected_time

    devices = assign_devices(config)
    initial = env.method.initial_global_state() if devices else None
    rows: dict[str, dict[str, Any]] = {}
    for client, budget in enumerate(env.budgets):
        if budget is None or budget.tier in rows:
            continue
        ctx = round_one(config, env, client)
        task = env.method.plan(ctx, env.method.init_state())
        cost = None if task is None else env.method.training_cost(task, min(config.fl.batch_size, ctx.num_samples))
        rows[budget.tier] = {
            "tier": budget.tier,
            "budget_bytes": budget.memory_bytes,
            "plan": "sits out: nothing fits" if task is None else describe_task(task),
            "peak_bytes": None if cost is None else cost.peak_bytes,
        }
        if devices and task is not None:
            t = expected_time(env.method, task, initial, devices[client])
            rows[budget.tier].update({"client": client, "down_s": t.down_s, "compute_s": t.compute_s, "up_s": t.up_s, "round_s": t.finish})
        if devices and (ladder := env.method.ladder):  # what a deadline (fl.deadline_plans) chooses among
            rows[budget.tier]["level_round_s"] = {
                level.name: expected_time(env.method, ladder.task_for(ctx, level), initial, devices[client]).finish for level in ladder.levels}
    return sorted(rows.values(), key=lambda r: r["budget_bytes"] or 0)


def block_rows(config: ExperimentConfig, env: ClientEnvironment) -> list[dict[str, Any]]:
    """Per body block: its channels, weights and saved activations, FeDepth's Table 1 unit (the
    block's weights, gradients, optimiser state and saved activations) and the measured peak of
    training it alone with the model resident, at the config's batch size."""
    accountant, batch = env.accountant, config.fl.batch_size
    model = env.method.model
    blocks = []
    for block in model.blocks():
        cost = accountant.block_cost(block.index, batch, config.model.width)
        block_params = sum(p.numel() * p.element_size() for p in model.body[block.index].parameters())
        blocks.append({
            "block": block.index + 1,
            "channels": {g.name: g.size for g in model.channel_groups()}[block.out_group],
            "param_bytes": block_params,
            "activation_bytes": cost.activation_bytes,
            # The block's weights, their gradients and optimiser state, and its saved activations.
            "block_training_bytes": block_params * (2 + OPTIMIZER_STATE_COPIES[accountant.optimizer]) + cost.activation_bytes,
            "peak_bytes": cost.peak_bytes,
        })
    return blocks


def width_rows(config: ExperimentConfig, env: ClientEnvironment) -> list[dict[str, Any]]:
    """What training the whole plain model costs at each of `REPORT_WIDTHS`, at the config's batch size."""
    widths = []
    for text in REPORT_WIDTHS:
        cost = env.accountant.plain_cost(parse_width(text), config.fl.batch_size)
        widths.append({
            "width": text,
            "param_bytes": cost.param_bytes,
            "activation_bytes": cost.activation_bytes,
            "peak_bytes": cost.peak_bytes,
            "train_flops_per_sample": cost.train_flops_per_sample,
        })
    return widths


def tier_rows(config: ExperimentConfig, env: ClientEnvironment) -> list[dict[str, Any]]:
    """The budget tiers: their clients and the budgets their amounts resolve to."""
    tier_list, budgets = assign_budgets(config, env.accountant, [len(p) for p in env.partitions])
    counts = Counter(b.tier for b in budgets if b is not None)
    tiers = []
    for tier in tier_list:
        first = next(b for b in budgets if b is not None and b.tier == tier.name)
        tiers.append({"tier": tier.name, "clients": counts[tier.name], "memory": tier.memory,
                      "memory_bytes": first.memory_bytes, "upload_bytes": first.upload_bytes, "flops": tier.flops})
    return tiers


def table_method(config: ExperimentConfig, env: ClientEnvironment, name: str, sparsity: float, norm: str | None = None) -> Method:
    """Method `name` at `sparsity` on the experiment's data and model, with the configured mask
    schedule, `norm` (default its own: `model.norm=auto`, the method's) and its own accountant."""
    if norm is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, norm=norm))
    cls = METHODS.get(name)
    fields: dict[str, Any] = {"name": name}
    if issubclass(cls, SparseStart):
        fields["sparsity"] = sparsity
    if issubclass(cls.Config, AdjustedSparseConfig) and isinstance(config.method, AdjustedSparseConfig):
        fields.update(adjust_every=config.method.adjust_every, stop_round=config.method.stop_round)
    method_config = build_dataclass(cls.Config, fields, "method.")
    own = dataclasses.replace(config, method=method_config)
    accountant = accountant_for(own, env.data)
    resources = dataclasses.replace(
        env.method.resources,
        model=build_model_for(own, env.data),
        build=lambda width, norm=None: build_model_for(own, env.data, width, norm),
        accountant=accountant,
    )
    return cls(method_config, resources)


def layer_forward_flops(model: nn.Module, sample: torch.Tensor) -> tuple[int, dict[str, int]]:
    """Forward FLOPs of one sample (a batch of one): the whole model's, and per module (by name) that owns a weight."""
    root = type(model).__name__
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.eval()(sample)
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    per_module = {name: counts.get(f"{root}.{name}", 0) for name, _ in model.named_modules() if name}
    return counts.get("Global", 0), per_module


def activation_elements(model: nn.Module, batch: torch.Tensor) -> int:
    """n_a of FedMef's F_o: the input entries of every Conv2d and Linear in one `batch` (what SAP sorts)."""
    total = 0

    def count(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        nonlocal total
        total += inputs[0].numel()

    hooks = [m.register_forward_pre_hook(count) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model.eval()(batch)
    for hook in hooks:
        hook.remove()
    return total


def sparse_rows(config: ExperimentConfig, env: ClientEnvironment, sparsities: tuple[float, ...] = SPARSITIES) -> list[dict[str, Any]]:
    """FedMef's Table 1 / Table 5 quantities for one client of the mean partition size in one
    adjustment round (the first, round ΔR), per method and sparsity (FedAvg once, dense):

    - params: the global model's weights in the appendix's sparse storage by density;
    - activations: the bytes autograd saves for backward in one batch, measured on the client's model
      (SAP's compressed copies for FedMef); peak: hfl's measured training peak, which holds pruned
      weights masked-dense as hfl trains them (FedTiny's equals FedAvg's); sparse_peak: that peak with
      the pruned weights held as a sparse client stores them, their kept values and positions in the
      storage uploads are counted in (`sparse_weight_saving`; gradients and optimiser state stay dense);
    - paper_memory: the appendix's estimate from these, 2M_p + 2M_a (FedAvg, FL-PQSU), + M_ξ (FedDST,
      FedTiny), 2M_p + M_a(SAP) + M_a(dense) + M_ξ (FedMef), M_ξ the top-ξ gradients and positions;
      each row's M_a from its own model, so the rows on the norm-free model ("fedtiny, no norms",
      "fedmef", "fedmef, no SAP") share one activation basis and the others another (batch norm);
    - train_flops: the appendix's round total, 3F·N·E for dense or static training, with the last batch
      a dense gradient (2F_d) for the dynamic methods and F_o = 4(1 − s)n_θ + n_a·log₂n_a added per
      batch for FedMef; F_s the forward FLOPs with every layer's scaled by its density (2 FLOPs per
      multiply-add; the paper counts one, which cancels in the ratios);
    - exchange: bytes down and up (sparse weights, FedTiny's and FedMef's uploaded gradients)."""
    num_samples = round(sum(len(p) for p in env.partitions) / len(env.partitions))
    batch = min(config.fl.batch_size, num_samples)
    adjust_round = config.method.adjust_every if isinstance(config.method, AdjustedSparseConfig) else 10
    rows = []
    methods: dict[tuple, Method] = {}  # "fedmef, no SAP" is FedMef's row's method, measured without SAP
    for label in SPARSE_TABLE_METHODS:
        name, _, variant = label.partition(", ")
        for sparsity in (sparsities[:1] if name == "fedavg" else sparsities):
            norm = "none" if variant == "no norms" else None
            if (name, sparsity, norm) not in methods:
                methods[name, sparsity, norm] = table_method(config, env, name, sparsity, norm)
            method = methods[name, sparsity, norm]
            ctx = dataclasses.replace(round_one(config, env, 0, adjust_round), num_samples=num_samples)
            task = method.plan(ctx, method.init_state())
            if name == "fedmef":
                without_sap = lambda: Method.client_model(method, task.spec)  # the same NSConv model, inputs kept whole
                key = ("without SAP", task.spec.shape, task.spec.frozen)  # measured once for both FedMef rows
                dense_activations = method.resources.accountant.cost(key, without_sap, batch, count_flops=False)
            # Without SAP FedMef trains the model just measured: its SAP model (and SAP's choice of
            # ReLU masks, two more measurements of the whole model) is not measured for that row.
            cost = dense_activations if variant == "no SAP" else method.training_cost(task, batch)
            masks = task.spec.masks
            params = method.upload_bytes(task.spec)
            counts = task.options.counts if isinstance(task.options, Adjustment) else {}
            gradient_bytes = sum(counts.values()) * (4 + 4)  # float32 values and int32 positions
            dense_flops, per_module = layer_forward_flops(method.model, env.accountant.zero_inputs(1))
            sparse_flops = dense_flops - sum(per_module[k.rsplit(".", 1)[0]] * (1 - float(m.float().mean())) for k, m in masks.items())
            samples = num_samples * config.fl.local_epochs
            dynamic = name in ("feddst", "fedtiny", "fedmef")
            if name == "fedmef":
                if variant == "no SAP":
                    paper_memory = 2 * params + 2 * cost.activation_bytes + gradient_bytes
                else:
                    n_theta = sum(method.model.state_dict()[k].numel() for k in prunable_keys(method.model))
                    n_a = activation_elements(method.model, env.accountant.zero_inputs(batch))
                    sparse_flops += (4 * (1 - sparsity) * n_theta + n_a * math.log2(n_a)) / batch
                    paper_memory = 2 * params + cost.activation_bytes + dense_activations.activation_bytes + gradient_bytes
            else:
                paper_memory = 2 * params + 2 * cost.activation_bytes + (gradient_bytes if dynamic else 0)
            flops = 3 * sparse_flops * samples
            if dynamic:  # the last batch's dense gradient replaces its sparse backward
                flops += (2 * dense_flops - 2 * sparse_flops) * batch
            rows.append({
                "method": label,
                "sparsity": 0.0 if name == "fedavg" else sparsity,
                "param_bytes": params,
                "activation_bytes": cost.activation_bytes,
                "peak_bytes": cost.peak_bytes,
                "sparse_peak_bytes": cost.peak_bytes - sparse_weight_saving(method.model.state_dict(), masks),
                "paper_memory_bytes": paper_memory,
                "train_flops": int(flops),
                "bytes_down": params,
                "bytes_up": params + gradient_bytes,
            })
    dense = rows[0]
    for row in rows:
        row["flops_ratio"] = row["train_flops"] / dense["train_flops"]
        row["exchange_ratio"] = (row["bytes_down"] + row["bytes_up"]) / (dense["bytes_down"] + dense["bytes_up"])
    return rows


def budget_report(config: ExperimentConfig, env: ClientEnvironment) -> dict[str, Any]:
    return {
        "model": config.model.name,
        "model_width": config.model.width,
        "dataset": config.data.name,
        "input_shape": list(env.accountant.input_shape),
        "input_kind": env.data.input_kind,
        "batch_size": config.fl.batch_size,
        "optimizer": env.accountant.optimizer,
        "blocks": block_rows(config, env),
        "widths": width_rows(config, env),
        "scenario": config.budgets.scenario,
        "tiers": tier_rows(config, env),
        "plans": tier_plans(config, env),
        **({"levels": ladder.rows(round_one(config, env, 0)), "levels_title": ladder.title} if (ladder := env.method.ladder) else {}),
        **({"sparse": sparse_rows(config, env)} if isinstance(env.method, SparseStart) else {}),
    }
