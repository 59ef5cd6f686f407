"""What each level of a method costs on every member of a pretrained family, measured by hfl's
accountant: training peak memory, training FLOPs per sample and upload bytes, smallest level to
largest. CAFF's baselines run on one member each (`--choose`, from the JSON this writes): the
deepest member whose smallest level fits the given (weakest client's) constraints, or with
`--level largest` whose full model fits them (the strongest client's): CAFF's appendix B gives
HeteroFL, FjORD and DepthFL the deepest model one client can train whole.

    python benchmarks/caff_member_costs.py experiments/caff_table1/hetlora.yaml --json COSTS.json [overrides]
    python benchmarks/caff_member_costs.py --choose COSTS.json --memory 55MiB --upload 1GB --flops 1e15 [--all]

The config names one member (`model.name`, `model.pretrained=FAMILY:l`); the others are the same
family's registered models (`hfl.models.family.MEMBER_MODELS`). `--choose` prints the overrides
that run the chosen member (`model.name=... model.pretrained=FAMILY:l`), or `none`; with `--all`, one
such line per fitting member (the paper's best of four members for some columns). A FLOPs amount is
in the unit of the config's `budgets.flops_per`: per mini-batch (CAFF's appendix A: "GFLOPs required
for a single mini-batch", what the grids use) bounds one full batch, per round the round of the client
with the most samples.
"""

from __future__ import annotations

import argparse
import json
import sys

from hfl.accounting.amounts import absolute_amount
from hfl.config import load_config

# `--choose` runs once per cell of a grid, so torch (models, environments) is imported only where costs
# are measured: a choice takes 0.1 s, not 1.7.


def member_overrides(model_name: str, pretrained: str) -> dict[int, list[str]]:
    """The overrides that run each member of the family `model.name=model_name
    model.pretrained=pretrained` belongs to, by depth."""
    from hfl.models.family import family_members

    family = pretrained.rpartition(":")[0]
    members = family_members(model_name)
    if not family or not members:
        raise SystemExit(f"model.name={model_name} model.pretrained={pretrained!r} names no pretrained family member")
    return {depth: [f"model.name={name}", f"model.pretrained={family}:{depth}"] for depth, name in members.items()}


def member_costs(config_path: str, member: list[str], depth: int, overrides: list[str]) -> tuple[list[dict], dict]:
    """Every ladder level's costs for the config run on the family member of depth `depth` (`member`: its overrides)."""
    from hfl.backends.base import ClientEnvironment
    from hfl.budget import round_one

    extra = [*member, "budgets.scenario=none", "budgets.memory=[]"]
    config = load_config(config_path, [*extra, *overrides])
    env = ClientEnvironment.from_config(config)
    method, ctx = env.method, round_one(config, env, 0)
    batch = config.fl.batch_size  # what every client with a full batch pays; smaller clients pay less
    rows = []
    for level in method.ladder.levels:
        task = method.ladder.task_for(ctx, level)
        cost = method.training_cost(task, batch)
        rows.append({"depth": depth, "level": level.name, "peak_bytes": cost.peak_bytes,
                     "train_flops_per_sample": cost.train_flops_per_sample, "upload_bytes": method.upload_bytes(task.spec)})
    return rows, {"max_samples": max(len(p) for p in env.partitions), "local_epochs": config.fl.local_epochs,
                  "batch_size": batch, "flops_per": config.budgets.flops_per}


def round_flops(costs: dict, row: dict) -> int:
    """What a FLOPs budget bounds for the level in `row`, in the budget's unit (`flops_per`): one
    mini-batch of a client with a full batch (CAFF's unit), or a round of the client with the most
    samples (then it alone decides which members are feasible)."""
    if costs.get("flops_per", "round") == "batch":
        return row["train_flops_per_sample"] * costs["batch_size"]
    return row["train_flops_per_sample"] * costs["max_samples"] * costs["local_epochs"]


def fitting_members(costs: dict, memory: int, upload: int, flops: int, level: str = "smallest") -> list[int]:
    """The members (depths, deepest first) whose `level` (smallest or largest) fits memory, upload
    and FLOPs (`round_flops`)."""
    fitting = [r["depth"] for r in costs["rows"] if r["level"] == costs[level][str(r["depth"])]
               and r["peak_bytes"] <= memory and r["upload_bytes"] <= upload and round_flops(costs, r) <= flops]
    return sorted(fitting, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--depths", default="3,6,9,12")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--choose", metavar="COSTS", help="print the overrides of the deepest member fitting --memory, --upload and --flops ('none' if none)")
    parser.add_argument("--memory", default="1e15")
    parser.add_argument("--upload", default="1e15")
    parser.add_argument("--flops", default="1e18")
    parser.add_argument("--level", choices=("smallest", "largest"), default="smallest")
    parser.add_argument("--all", action="store_true", help="with --choose: every fitting member, one line each, deepest first")
    args = parser.parse_args()
    if args.choose:
        with open(args.choose) as f:
            costs = json.load(f)
        depths = fitting_members(costs, absolute_amount(args.memory), absolute_amount(args.upload), absolute_amount(args.flops), args.level)
        for depth in (depths if args.all else depths[:1]):
            print(" ".join(costs["members"][str(depth)]))
        if not depths:
            print("none")
        return 0
    model = load_config(args.config, args.overrides).model
    members = member_overrides(model.name, model.pretrained)
    rows, smallest, largest, scale = [], {}, {}, {}
    for d in args.depths.split(","):
        member, scale = member_costs(args.config, members[int(d)], int(d), args.overrides)
        rows += member
        smallest[d], largest[d] = member[0]["level"], member[-1]["level"]
    costs = {"rows": rows, "smallest": smallest, "largest": largest, **scale, "members": {str(d): members[int(d)] for d in smallest}}
    print(f"{'l':>3} {'level':>8} {'peak MiB':>10} {'MFLOPs/sample':>14} {'GFLOPs/' + scale['flops_per']:>13} {'upload MiB':>11}")
    for r in rows:
        print(f"{r['depth']:>3} {r['level']:>8} {r['peak_bytes'] / 2**20:>10.2f} {r['train_flops_per_sample'] / 1e6:>14.1f} "
              f"{round_flops(costs, r) / 1e9:>13.2f} {r['upload_bytes'] / 2**20:>11.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(costs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
