"""NeFL — Kang, Cha, Kim and Kim, "NeFL: Nested Model Scaling for Federated Learning with System
Heterogeneous Clients" (arXiv:2308.07761). Nested sub-models scaled in width and depth, every
residual block computing Y + s F(Y) with learnable step sizes; step sizes and batch norms are kept
per sub-model ("inconsistent") and averaged among that sub-model's clients (FedAvg), every other
parameter by NeFedAvg.

Sub-models. `method.gammas` are target parameter ratios (default 0.2, 0.4, 0.6, 0.8, 1).
- NeFL-W (`scaling=w`): the width ratio whose sub-model holds the target share of the parameters
  (every layer scaled alike, channels kept from the front as in HeteroFL/FjORD).
- NeFL-D (`scaling=d`): blocks are omitted until the parameter ratio is met, and no more than
  needed: of all sets of blocks whose omission meets it, the one leaving the most parameters (the
  paper picks its sub-models by hand to match the ratios, Table 8). Among blocks of equal size the
  last block of each stage goes first, deepest stage first (later blocks refine what earlier ones
  computed; the paper's ResNet-56 sub-models keep each stage's first blocks), stage-opening blocks
  last (a block that changes the feature shape keeps its projection shortcut, as the paper's
  ResNet-18 sub-models do).
- NeFL-WD (`scaling=wd`): gamma = gamma_W * gamma_D with gamma_D = gamma^depth_exponent (balanced
  by default), the width then solved for the whole sub-model to hold gamma of the parameters.
Step sizes start at 1 (NeFL-D) or, with `initial_steps=do`, a kept block followed by k omitted ones
starts at k + 1 (NeFL-DO); `learnable_steps=false` keeps them at their initial values (N/L).

Aggregation (Algorithm 2). NeFedAvg averages each entry of the consistent parameters over the
clients whose sub-model holds it, which is the shared masked mean: in appendix B.3's example a
slice held by sub-models 1, 3 and 5 is averaged over all their clients, the part only 3 and 5 hold
over theirs, and so on. Inconsistent parameters live once per sub-model in the global state
(`<norm>.m<k>.*`, `body.<i>.step.m<k>`), so the same mean is FedAvg over that sub-model's clients.
Both divide by client counts, as Algorithm 2 does (not by sample counts).

Clients (appendix B.7): five tiers, each drawing its sub-model every round among those within
`tier_window` of its own (`hfl.methods.tiers`); with memory budgets a client's tier is the largest
sub-model whose training fits, and only fitting sub-models are drawn.

Models without residual blocks (the CNN) have no step sizes and no blocks to omit: NeFL-WD then
scales width alone, and NeFL-D is refused.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from hfl.accounting.accountant import Accountant
from hfl.accounting.budgets import ClientBudget
from hfl.accounting.cost import TrainingCost
from hfl.config import check, check_choice
from hfl.errors import ConfigError
from hfl.methods.base import Method, MethodConfig, MethodState
from hfl.methods.tiers import DynamicTiers
from hfl.models.base import ResidualBlock, ScalableModel, nefl_do_step_sizes
from hfl.registry import METHODS
from hfl.submodel.aggregate import masked_weighted_mean
from hfl.submodel.spec import SubmodelSpec, drop_blocks, width_spec
from hfl.types import ClientTask, ClientUpdate, RoundContext, StateDict

log = logging.getLogger(__name__)

SCALINGS = ("w", "d", "wd")
INITIAL_STEPS = ("ones", "do")


@dataclass(frozen=True)
class NeFLConfig(MethodConfig):
    name: str = "nefl"
    scaling: str = "wd"
    """'w' width only (NeFL-W), 'd' depth only (NeFL-D), 'wd' both (NeFL-WD)."""
    gammas: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 1.0)
    """Each sub-model's target share of the global model's parameters, ascending; the last is 1."""
    learnable_steps: bool = True
    """Train the step sizes (False: the paper's N/L ablation, constant at their initial values)."""
    initial_steps: str = "ones"
    """'ones' (NeFL-D) or 'do' (NeFL-DO: a kept block followed by k omitted ones starts at k + 1)."""
    inconsistent: bool = True
    """Keep batch norms and step sizes per sub-model (False: everything averaged by NeFedAvg)."""
    depth_exponent: float = 0.5
    """NeFL-WD's split of gamma: gamma_D = gamma ** depth_exponent, the width taking the rest."""
    tier_window: int = 2
    """Appendix B.7: each round a client draws among the sub-models within this many of its tier's;
    -1: no draw, each client trains the largest sub-model fitting its budget (the whole model without one)."""

    def __post_init__(self) -> None:
        check_choice("scaling", self.scaling, SCALINGS)
        check_choice("initial_steps", self.initial_steps, INITIAL_STEPS)
        gammas = list(self.gammas)
        check(bool(gammas) and all(0 < g <= 1 for g in gammas) and gammas == sorted(set(gammas)) and gammas[-1] == 1,
              "gammas", gammas, "ascending ratios in (0, 1] ending with 1")
        check(0 <= self.depth_exponent <= 1, "depth_exponent", self.depth_exponent, "a number in [0, 1]")
        check(self.tier_window >= -1, "tier_window", self.tier_window, "an integer >= -1")
        check(self.inconsistent or self.initial_steps == "ones", "initial_steps", self.initial_steps,
              "'ones' when inconsistent=false (NeFL-DO's values differ per sub-model)")


class NormCopies(nn.Module):
    """One batch norm per sub-model, each with the layer's full channel count; the model runs the
    `active` copy (a client model holds only its own)."""

    def __init__(self, norm: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        for name in names:
            self.add_module(name, copy.deepcopy(norm))
        self.active = names[-1]

    def forward(self, x: Tensor) -> Tensor:
        return getattr(self, self.active)(x)


class StepCopies(nn.Module):
    """One learnable step size per sub-model; returns the `active` one."""

    def __init__(self, values: dict[str, float], like: Tensor) -> None:
        super().__init__()
        for name, value in values.items():
            self.register_parameter(name, nn.Parameter(torch.tensor(value, dtype=like.dtype, device=like.device)))
        self.active = list(values)[-1]

    def forward(self) -> Tensor:
        return getattr(self, self.active)


COPIES = (NormCopies, StepCopies)


def keep_copy(model: nn.Module, name: str) -> None:
    """Reduce every per-sub-model copy set of `model` to sub-model `name`'s."""
    for module in model.modules():
        if isinstance(module, COPIES):
            for other, _ in list(module.named_children()) + list(module.named_parameters(recurse=False)):
                if other != name:
                    delattr(module, other)
            module.active = name


def held_parameters(model: ScalableModel, spec: SubmodelSpec) -> int:
    """Parameters of `model` a client of `spec` holds (no buffers)."""
    total = 0
    for key, param in model.named_parameters():
        if key in spec.absent:
            continue
        dims = spec.indices.get(key, {})
        count = 1
        for d, size in enumerate(param.shape):
            count *= len(dims[d]) if d in dims else size
        total += count
    return total


def omission_order(model: ScalableModel) -> list[int]:
    """Body blocks in the order NeFL-D omits them (see the module docstring)."""
    blocks = model.blocks()
    omittable = {b.index for b in blocks if isinstance(model.body[b.index], ResidualBlock)
                 and (b.droppable or model.body[b.index].shortcut_modules)}
    stages: list[list[int]] = []
    for b in blocks:
        if stages and blocks[stages[-1][-1]].out_group == b.out_group:
            stages[-1].append(b.index)
        else:
            stages.append([b.index])
    tails = [[i for i in stage[1:] if i in omittable] for stage in stages]
    order = []
    while any(tails):
        for tail in reversed(tails):
            if tail:
                order.append(tail.pop())
    return order + [stage[0] for stage in reversed(stages) if stage[0] in omittable]


def blocks_to_omit(order: Sequence[int], saved: dict[int, int], total: int, target: float) -> frozenset[int]:
    """The blocks whose omission leaves the most parameters within `target * total` (omitting block
    b saves `saved[b]`), or among those within 1 % of the parameters of it the one omitting fewest
    blocks: an exact subset sum over the distinct block sizes; blocks of one size are
    interchangeable for the count, so they go in `order`'s preference."""
    need = total - target * total * (1 + 1e-9)
    if need <= 0:
        return frozenset()
    classes: dict[int, list[int]] = {}
    for block in order:
        classes.setdefault(saved[block], []).append(block)
    reachable: dict[int, tuple[int, ...]] = {0: ()}  # parameters saved -> blocks omitted per size class
    for size, blocks in classes.items():
        grown: dict[int, tuple[int, ...]] = {}
        for removed, counts in reachable.items():
            for count in range(len(blocks) + 1):
                key, choice = removed + count * size, (*counts, count)
                if key not in grown or sum(choice) < sum(grown[key]):
                    grown[key] = choice
        reachable = grown
    enough = [r for r in reachable if r >= need] or [max(reachable)]
    # Within 1 % of the parameters of the closest fit, omit as few blocks as possible (depth is
    # what a depth-scaled sub-model loses; many small blocks for a near-exact ratio is the worse trade).
    close = [r for r in enough if r <= min(enough) + 0.01 * total]
    counts = min((reachable[r] for r in close), key=lambda c: (sum(c), 0))
    return frozenset(b for blocks, count in zip(classes.values(), counts) for b in blocks[:count])


@dataclass(frozen=True)
class Submodel:
    """One nested sub-model: width ratio (relative to the global model) and omitted blocks."""

    index: int
    """1-based, smallest first (the paper's model index)."""
    gamma: float
    width: float
    omitted: frozenset[int]
    params: int

    @property
    def copy_name(self) -> str:
        return f"m{self.index}"

    @property
    def name(self) -> str:
        return f"x{self.gamma:g}"


@METHODS.register("nefl")
class NeFL(Method):
    Config = NeFLConfig
    paper = "Kang, Cha, Kim and Kim, 2023 (arXiv:2308.07761)"
    preferred_norm = "bn"
    level_table_title = "NeFL's Table 8; params ratio: achieved share of the parameters beside the target gamma"

    def __init__(self, config: NeFLConfig, model: ScalableModel, accountant: Accountant | None = None) -> None:
        super().__init__(config, model, accountant)
        self.residual = any(isinstance(b, ResidualBlock) for b in model.body)
        if config.scaling == "d" and not self.residual:
            raise ConfigError("method.scaling", "d", f"'w' or 'wd': {type(model).__name__} has no residual blocks to omit")
        self.total_params = held_parameters(model, SubmodelSpec())
        self.order = omission_order(model) if self.residual else []
        """Blocks depth scaling may omit, in the order equal-sized ones go."""
        self.saved = {b: self.total_params - held_parameters(model, drop_blocks(SubmodelSpec(), model, {b})) for b in self.order}
        """Parameters omitting each block saves."""
        self.submodels_ = [self._scale(k, g) for k, g in enumerate(config.gammas, start=1)]
        self.tiers = DynamicTiers.for_window(len(self.submodels_), config.tier_window)
        self.batch_size = 32
        self._specs: dict[int, SubmodelSpec] = {}
        self._costs: dict[tuple, TrainingCost] = {}
        self._copy_keys: dict[str, frozenset[str]] = {}

    # -- sub-models -----------------------------------------------------------------------------
    def _params(self, width: float, omitted: frozenset[int]) -> int:
        return held_parameters(self.model, drop_blocks(width_spec(self.model, self.model.width * width), self.model, omitted))

    def _scale(self, index: int, gamma: float) -> Submodel:
        """The sub-model holding `gamma` of the parameters under the configured scaling."""
        scaling, total = self.config.scaling, self.total_params
        omitted: frozenset[int] = frozenset()
        if "d" in scaling and self.residual and gamma < 1:
            depth_gamma = gamma if scaling == "d" else gamma**self.config.depth_exponent
            omitted = blocks_to_omit(self.order, self.saved, total, depth_gamma)
        width = 1.0
        if "w" in scaling and gamma < 1:
            width = self._width_for(gamma * total, omitted)
        return Submodel(index, gamma, width, omitted, self._params(width, omitted))

    def _width_for(self, target: float, omitted: frozenset[int]) -> float:
        """The largest width ratio whose sub-model (with `omitted` blocks) holds at most `target`
        parameters; bisection, the count being monotone in the width."""
        if self._params(1.0, omitted) <= target:
            return 1.0
        lo, hi = 0.0, 1.0
        for _ in range(30):
            mid = (lo + hi) / 2
            if mid > 0 and self._params(mid, omitted) <= target:
                lo = mid
            else:
                hi = mid
        return max(lo, 1e-3)

    def copy_keys(self, name: str) -> frozenset[str]:
        """Global state keys of sub-model `name`'s inconsistent copies."""
        if name not in self._copy_keys:
            self._copy_keys[name] = frozenset(
                f"{path}.{key}"
                for path, module in self.model.named_modules() if isinstance(module, COPIES)
                for key in module.state_dict() if key.partition(".")[0] == name
            )
        return self._copy_keys[name]

    def spec_for(self, index: int) -> SubmodelSpec:
        """Sub-model `index` (1-based): its width slice, omitted blocks, and its own copies only."""
        if index not in self._specs:
            sub = self.submodels_[index - 1]
            spec = drop_blocks(width_spec(self.model, self.model.width * sub.width), self.model, sub.omitted)
            if self.config.inconsistent:
                others = frozenset().union(*(self.copy_keys(s.copy_name) for s in self.submodels_ if s.index != index))
                spec = replace(spec, absent=spec.absent | others)
            if not self.config.learnable_steps:
                spec = replace(spec, frozen=spec.frozen | (frozenset(self.model.step_size_keys()) - spec.absent))
            self._specs[index] = spec
        return self._specs[index]

    def held_copy(self, spec: SubmodelSpec) -> tuple[str, ...]:
        """Names of the sub-model copies a spec holds (one for NeFL's specs, all for the whole state)."""
        if not self.config.inconsistent:
            return ()
        return tuple(s.copy_name for s in self.submodels_ if not self.copy_keys(s.copy_name) <= spec.absent)

    # -- models ---------------------------------------------------------------------------------
    def initial_steps(self, sub: Submodel, blocks: int) -> list[float]:
        if self.config.initial_steps == "do":
            return nefl_do_step_sizes(blocks, sub.omitted)
        return [1.0] * blocks

    def adapt_model(self, model: ScalableModel) -> ScalableModel:
        """Batch norms and step sizes per sub-model (one of each when `inconsistent=false`)."""
        names = [s.copy_name for s in self.submodels_]
        if self.config.inconsistent:
            model.replace_norms(lambda norm: NormCopies(norm, names))
        if not self.residual:
            return model
        model.add_step_sizes(1.0)
        if self.config.inconsistent:
            starts = {s.copy_name: self.initial_steps(s, len(model.body)) for s in self.submodels_}
            for i, block in enumerate(model.body):
                if isinstance(block, ResidualBlock) and not block.branch_skipped:
                    for step in block.step_names:
                        like = getattr(block, step)
                        delattr(block, step)  # a parameter slot takes no module
                        setattr(block, step, StepCopies({n: starts[n][i] for n in names}, like))
        return model

    def model_key(self, spec: SubmodelSpec) -> tuple:
        return (*super().model_key(spec), self.held_copy(spec))

    def client_model(self, spec: SubmodelSpec, build: Callable[[float], ScalableModel]) -> nn.Module:
        model = super().client_model(spec, build)
        held = self.held_copy(spec)
        if len(held) == 1:
            keep_copy(model, held[0])
        return model

    def training_cost(self, spec: SubmodelSpec, batch_size: int) -> TrainingCost:
        """Measured on the client's model (its own copies only, not every sub-model's)."""
        key = (self.model_key(spec), spec.frozen, batch_size)
        if key not in self._costs:
            acc = self.accountant
            if acc is None:
                raise RuntimeError("training costs need an accountant")
            model = self.client_model(spec, lambda width: self.adapt_model(acc.build(width)))
            for name, param in model.named_parameters():
                param.requires_grad_(name not in spec.frozen)
            self._costs[key] = acc.measure(model, batch_size)
        return self._costs[key]

    # -- plan -----------------------------------------------------------------------------------
    def use_budgets(self, budgets: Sequence[ClientBudget | None], batch_size: int) -> None:
        self.batch_size = batch_size
        if self.tiers is not None:
            self.tiers.use_budgets(budgets)

    def fits(self, ctx: RoundContext, index: int) -> bool:
        budget = ctx.budget.memory_bytes if ctx.budget else None
        if budget is None or self.accountant is None:
            return True
        return self.training_cost(self.spec_for(index), min(ctx.train.batch_size, ctx.num_samples)).peak_bytes <= budget

    def plan(self, ctx: RoundContext, state: MethodState) -> ClientTask | None:
        count = len(self.submodels_)
        if self.tiers is not None:
            levels = self.tiers.allowed(ctx, lambda k: self.fits(ctx, k + 1))
            level = self.tiers.pick(ctx, levels)
            allowed = [k + 1 for k in levels]
        else:
            level = next((k for k in reversed(range(count)) if self.fits(ctx, k + 1)), None)
            allowed = [] if level is None else [level + 1]
        if level is None:
            log.info("client %d: not even sub-model 1 fits its budget", ctx.client_id)
            return None
        sub = self.submodels_[level]
        return ClientTask(ctx, self.spec_for(sub.index), {"submodel": sub.index, "gamma": sub.gamma, "allowed": allowed})

    def describe_task(self, task: ClientTask) -> str:
        o = task.options
        return f"sub-model {o['submodel']} (gamma {o['gamma']:g}), drawn among {o['allowed']}"

    # -- aggregation and evaluation -------------------------------------------------------------
    def init_state(self) -> MethodState:
        return {"trained_submodels": []}

    def aggregate(
        self, global_state: StateDict, updates: list[ClientUpdate], state: MethodState
    ) -> tuple[StateDict, MethodState]:
        """Algorithm 2: every entry averaged over the clients that held it, each client counting once."""
        new = masked_weighted_mean(global_state, [replace(u, weight=1.0) for u in updates])
        by_key = {self.model_key(self.spec_for(s.index)): s.index for s in self.submodels_}
        trained = set(state.get("trained_submodels", [])) | {by_key[k] for u in updates if (k := self.model_key(u.spec)) in by_key}
        return new, {**state, "trained_submodels": sorted(trained)}

    def trained(self, state: MethodState) -> list[Submodel]:
        """Sub-models some client has trained (all of them before round 1)."""
        done = set(state.get("trained_submodels", []))
        return [s for s in self.submodels_ if s.index in done] or list(self.submodels_)

    def global_model_spec(self, state: MethodState) -> SubmodelSpec:
        return self.spec_for(self.trained(state)[-1].index)

    def submodels(self, state: MethodState) -> dict[str, SubmodelSpec]:
        return {s.name: self.spec_for(s.index) for s in self.trained(state)}

    def level_table(self) -> list[dict[str, Any]]:
        """The paper's Table 8 per sub-model: target and achieved parameter ratio, width, omitted
        blocks, parameters and forward FLOPs per sample; a last row with their means."""
        rows = []
        for sub in self.submodels_:
            flops = self.training_cost(self.spec_for(sub.index), self.batch_size).forward_flops_per_sample if self.accountant else None
            rows.append({"name": sub.name, "submodel": sub.index, "gamma": sub.gamma, "params_ratio": sub.params / self.total_params,
                         "width": sub.width, "omitted_blocks": ",".join(str(b + 1) for b in sorted(sub.omitted)) or "-",
                         "params": sub.params, "flops": flops})
        mean = {"name": "mean", "submodel": "mean", "gamma": sum(r["gamma"] for r in rows) / len(rows),
                "params_ratio": sum(r["params_ratio"] for r in rows) / len(rows), "width": None, "omitted_blocks": "",
                "params": sum(r["params"] for r in rows) / len(rows),
                "flops": None if rows[0]["flops"] is None else sum(r["flops"] for r in rows) / len(rows)}
        return [*rows, mean]
