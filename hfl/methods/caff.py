"""CAFF — Pfeiffer, Ahmed, Khalili and Henkel, "Efficient Federated Finetuning of Tiny Transformers with
Resource-Constrained Devices", 2024. From a family of pretrained transformers F_l (l blocks), the
server picks one; each client trains its last t blocks, the final norm and the output layer.

Configuration F_l^t trains blocks l-t+1..l, the head's LayerNorm and linear layer; the embeddings and
the first l-t blocks stay frozen (never trained, never sent). Its memory (weights, optimiser state,
saved activations), FLOPs (forward through all l blocks, backward through the trained part) and
upload (the trained tensors) are measured by hfl's accountant on that very client model.

Selection (Eq. 1-3): F_l is feasible when every client fits some t >= 1 within its memory, upload
and FLOPs budgets; each client takes its largest fitting t; the server picks the feasible l with
the largest mean t over all clients, ties to the larger l. Member l is the family's pretrained
model of depth l (`model.pretrained=FAMILY:L`; the configured model is the deepest member, L
blocks); without a family, the configured model's first l blocks, freshly initialised.

Aggregation (Eq. 4-5): the printed Eq. 5 does not sum to one; this is the form of the CoCoFL code
the paper builds on: per tensor, W <- rho * mean(received) + (1 - rho) * W_old with rho = |received|
/ |clients this round|, clients weighted equally; a tensor nobody trained keeps its value.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor

from hfl.errors import ConfigError, check
from hfl.methods.base import Method, MethodConfig, MethodState, Resources
from hfl.methods.transformer import embedding_keys, require_transformer
from hfl.registry import METHODS
from hfl.submodel.aggregate import masked_weighted_mean
from hfl.submodel.ladder import Ladder, Level
from hfl.submodel.spec import SubmodelSpec, block_keys, drop_blocks, freeze
from hfl.types import ClientUpdate, RoundContext, StateDict, TrainSettings


@dataclass(frozen=True)
class CAFFConfig(MethodConfig):
    name: str = "caff"
    weighting: str = "clients"
    """CoCoFL's averaging counts every client once."""
    depths: tuple[int, ...] = (3, 6, 9, 12)
    """The family's depths l to choose among (the paper's 3, 6, 9, 12), each at most the configured model's."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(bool(self.depths) and all(isinstance(d, int) and d >= 1 for d in self.depths), "depths", list(self.depths), "integers >= 1")


@dataclass(frozen=True)
class FinetuneOptions:
    """A client of F_l^t: it trains the last `trained` of `depth` blocks."""

    depth: int
    trained: int

    def __str__(self) -> str:
        return f"F_{self.depth}^{self.trained}: the last {self.trained} of {self.depth} blocks, the final norm and the output layer"


@dataclass(frozen=True)
class Selection:
    """Eq. 1-3's outcome: the chosen depth, each client's t there, and the mean t of every depth
    (None: infeasible, some client fits no t)."""

    depth: int
    trained: tuple[int, ...]
    mean_trained: Mapping[int, float | None]


def select_depth(depths: Sequence[int], clients: int, largest_fitting: Callable[[int, int], int]) -> Selection:
    """Eq. 1-3. `largest_fitting(l, c)`: client c's largest t in 1..l within its budgets, 0 when none fits."""
    means: dict[int, float | None] = {}
    fitted: dict[int, tuple[int, ...]] = {}
    for depth in sorted(depths):
        ts = tuple(largest_fitting(depth, c) for c in range(clients))
        feasible = all(t >= 1 for t in ts)
        means[depth] = sum(ts) / len(ts) if feasible and ts else None
        fitted[depth] = ts
    feasible_depths = [d for d, m in means.items() if m is not None]
    if not feasible_depths:
        raise ConfigError("budgets", "the clients' budgets", f"room for every client to train at least 1 block of some depth in {sorted(depths)} (`hfl budget` prints the costs)")
    best = max(feasible_depths, key=lambda d: (means[d], d))  # ties to the larger l
    return Selection(best, fitted[best], means)


def cocofl_mean(global_state: Mapping[str, Tensor], updates: Sequence[ClientUpdate]) -> dict[str, Tensor]:
    """W <- rho * mean(received) + (1 - rho) * W_old per tensor, rho = |received| / |updates|,
    each client once; untrained tensors keep their value."""
    mean = masked_weighted_mean(global_state, [replace(u, weight=1.0) for u in updates])
    received = Counter(key for u in updates for key in {u.spec.global_key(k) for k in u.state})
    new = dict(mean)
    for key, count in received.items():
        if global_state[key].is_floating_point():
            rho = count / len(updates)
            new[key] = rho * mean[key] + (1 - rho) * global_state[key]
    return new


@METHODS.register("caff")
class CAFF(Method):
    Config = CAFFConfig
    preferred_norm = "bn"

    def __init__(self, config: CAFFConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        require_transformer(self.model, "caff")
        blocks = len(self.model.body)
        for depth in config.depths:
            check(depth <= blocks, "depths", list(config.depths), f"depths of at most {blocks}, the blocks of the configured model (its deepest member)")
        self.depth = blocks  # until the selection: the deepest member, whose tensors' shapes (upload sizes) cover every member's
        self.ladders = {depth: self._depth_ladder(depth) for depth in config.depths}
        contexts = [self._selection_context(c) for c in range(len(resources.budgets))]
        self.selection = select_depth(config.depths, len(contexts), lambda depth, c: self._largest_fitting(depth, contexts[c]))
        self.depth = self.selection.depth
        title = f"CAFF's selection (Eq. 1-3): F_l^t per depth l and t blocks trained, at a full batch; chosen l = {self.depth}"
        # The chosen depth's ladder again, now with the selection's table for `hfl budget`: one ladder per depth.
        self.ladder = self.ladders[self.depth] = self._depth_ladder(self.depth, table=self.selection_rows, title=title)

    # -- the family's configurations F_l^t -----------------------------------------------------------
    def finetune_spec(self, depth: int, trained: int) -> SubmodelSpec:
        """F_l^t: blocks past l absent, the embeddings and the first l - t blocks frozen."""
        model = self.model
        spec = drop_blocks(SubmodelSpec(), model, range(depth, len(model.body)))
        return freeze(spec, embedding_keys(model) | block_keys(model, range(depth - trained)))

    def _depth_ladder(self, depth: int, **reporting: Any) -> Ladder:
        levels = [Level(f"l{depth}t{t}", self.finetune_spec(depth, t), FinetuneOptions(depth, t)) for t in range(1, depth + 1)]
        return self.make_ladder(levels, evaluated="none", global_model="largest", **reporting)

    def _selection_context(self, client: int) -> RoundContext:
        """Client `client` as round 1 sees it; fitting reads only its samples, batch and budget."""
        r = self.resources
        samples = r.client_samples[client] if r.client_samples else r.batch_size
        return RoundContext(1, client, r.seed, samples, TrainSettings(0.0, 0.0, 0.0, r.local_epochs, r.batch_size), r.budgets[client])

    def _largest_fitting(self, depth: int, ctx: RoundContext) -> int:
        ladder = self.ladders[depth]
        return next((k + 1 for k in reversed(range(len(ladder.levels))) if ladder.fits(ladder.levels[k], ctx)), 0)

    # -- models -----------------------------------------------------------------------------------
    def initial_global_state(self) -> StateDict:
        """Member l: the family's pretrained model of the chosen depth (or fresh weights without a family)."""
        model = self.client_model(self.finetune_spec(self.depth, self.depth))
        if self.resources.load_member is not None and not next(model.parameters()).is_meta:
            self.resources.load_member(model, self.depth)
        return model.state_dict()

    # -- aggregation --------------------------------------------------------------------------------
    def aggregate(self, global_state: StateDict, updates: list[ClientUpdate], state: MethodState) -> tuple[StateDict, MethodState]:
        return (cocofl_mean(global_state, updates) if updates else dict(global_state)), state

    # -- reporting ----------------------------------------------------------------------------------
    def selection_rows(self, ctx: RoundContext) -> list[dict[str, Any]]:
        """`hfl budget`'s table: every F_l^t at a full batch (measured peak memory, FLOPs per sample,
        upload), the mean t per l and the choice (a client with fewer samples than a batch pays less memory)."""
        rows = []
        for depth, ladder in self.ladders.items():
            for level in ladder.levels:
                cost = self.training_cost(ladder.task_for(ctx, level), ctx.train.batch_size)
                rows.append({"level": level.name, "depth": depth, "trained": level.options.trained, "peak_bytes": cost.peak_bytes,
                             "train_flops_per_sample": cost.train_flops_per_sample, "upload_bytes": self.upload_bytes(level.spec),
                             "mean_trained": self.selection.mean_trained[depth], "chosen": depth == self.depth})
        return rows
