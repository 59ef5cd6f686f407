"""The numbers behind `hfl budget`: per-block and per-width training memory, the tiers' budgets,
and the levels a method defines (ScaleFL's split ratios, NeFL's sub-models, with their costs)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hfl.accounting.amounts import parse_width
from hfl.accounting.budgets import assign_budgets
from hfl.accounting.cost import OPTIMIZER_STATE_COPIES
from hfl.backends.base import ClientEnvironment
from hfl.config import ExperimentConfig
from hfl.methods.base import describe_task
from hfl.types import RoundContext, TrainSettings

REPORT_WIDTHS = ("1/8", "1/6", "1/4", "1/3", "1/2", "1")


def round_one(config: ExperimentConfig, env: ClientEnvironment, client: int) -> RoundContext:
    fl = config.fl
    settings = TrainSettings(fl.lr, fl.momentum, fl.weight_decay, fl.local_epochs, fl.batch_size, fl.optimizer, fl.lr)
    return RoundContext(1, client, config.seed, len(env.partitions[client]), settings, env.budgets[client])


def tier_plans(config: ExperimentConfig, env: ClientEnvironment) -> list[dict[str, Any]]:
    """What the method asks of the first client of each tier in round 1, with its estimated peak."""
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


def budget_report(config: ExperimentConfig, env: ClientEnvironment) -> dict[str, Any]:
    return {
        "model": config.model.name,
        "model_width": config.model.width,
        "dataset": config.data.name,
        "input_shape": list(env.accountant.input_shape),
        "batch_size": config.fl.batch_size,
        "optimizer": env.accountant.optimizer,
        "blocks": block_rows(config, env),
        "widths": width_rows(config, env),
        "scenario": config.budgets.scenario,
        "tiers": tier_rows(config, env),
        "plans": tier_plans(config, env),
        **({"levels": ladder.rows(round_one(config, env, 0)), "levels_title": ladder.title} if (ladder := env.method.ladder) else {}),
    }
