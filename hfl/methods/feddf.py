"""FedDF — Lin, Kong, Stich and Jaggi, "Ensemble Distillation for Robust Model Fusion in Federated
Learning", NeurIPS 2020. After averaging, the server distils the ensemble of the round's client
models into the global model on unlabelled data: the student (the averaged model) minimises
KL(softmax(teacher / T) || softmax(student / T)) * T^2 with Adam, the teacher being the plain mean
of the client models' logits (the paper's AVGLOGITS).

Clients are width-heterogeneous as in HeteroFL (this class extends it): each trains the widest rate
whose training memory fits its budget, with static batch norm and the scaler, and the server first
takes the masked mean, then distils. ScaleFL compares against FedDF in this setting.

Deliberate deviations:
- The unlabelled data is a share of the training set that the server keeps without labels
  (`data.server_fraction`), not another dataset (the paper's CIFAR-100 / ImageNet for CIFAR-10).
- A fixed number of Adam steps (`distill_steps`) with the authors' cosine decay and gradient
  clipping, without their early stopping: that needs a labelled validation split on the server,
  and the paper's budget (up to 10^4 steps per round) is not affordable on a CPU.
- Teachers predict with batch-norm statistics recomputed on the unlabelled data and without the
  scaler, as the evaluator scores HeteroFL's sub-models (static-BN clients keep no statistics; the
  scaler is a training device, HeteroFL's Scaler is the identity at inference). The authors' teachers
  are ordinary BN models in eval mode with the statistics of their own data.
- The ensemble's logits are computed once per round on the whole unlabelled set, and the batch
  order derives from the seed, a counter in the method state and the cohort, so runs are
  reproducible and resume exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from hfl.errors import ConfigError, check
from hfl.losses import kl_distillation
from hfl.methods.base import MethodState, Resources
from hfl.methods.heterofl import HeteroFL, HeteroFLConfig
from hfl.models.base import ScalableModel
from hfl.registry import METHODS
from hfl.seeding import DISTILL_STREAM, derive_seed
from hfl.types import ClientUpdate, StateDict

log = logging.getLogger(__name__)

CHUNK = 1024  # inputs per forward pass when the teachers run over the whole unlabelled set
MAX_GRAD_NORM = 5.0  # the authors' clipping of the student's gradient
STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class FedDFConfig(HeteroFLConfig):
    name: str = "feddf"
    weighting: str = "samples"
    """Algorithm 1 starts distillation from the clients' average weighted by their data sizes."""
    distill_steps: int = 50
    """Adam steps of server distillation per round (the paper: up to 10^4, stopped early on a
    validation split). 50 is sized for CPU tests: about 5 s per round for PreResNet-20 on one CPU
    thread; raise it for real runs (on a GPU a step of PreResNet-20 takes milliseconds)."""
    distill_batch_size: int = 128
    """Unlabelled inputs per distillation step (the authors' 128)."""
    distill_samples: int = 0
    """Unlabelled inputs the round distils on, a fresh seeded sample each round (0: the whole server
    split). Every teacher runs over them, so on a CPU this bounds the round's cost."""
    distill_lr: float = 1e-3
    """Adam learning rate of the student, decayed to 0 over the round's steps by a cosine (as the authors)."""
    temperature: float = 1.0
    """Softmax temperature T of the distillation loss, which is scaled by T^2 (the authors' code uses 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.distill_steps >= 0, "distill_steps", self.distill_steps, "an integer >= 0")
        check(self.distill_batch_size >= 1, "distill_batch_size", self.distill_batch_size, "an integer >= 1")
        check(self.distill_samples >= 0, "distill_samples", self.distill_samples, "an integer >= 0 (0: all)")
        check(self.distill_lr > 0, "distill_lr", self.distill_lr, "a number > 0")
        check(self.temperature > 0, "temperature", self.temperature, "a number > 0")


def track_statistics(model: nn.Module) -> nn.Module:
    """Give every batch-norm layer running statistics (static-BN layers keep none), so a teacher can
    predict with statistics recomputed on the server's data."""
    for norm in model.modules():
        if isinstance(norm, nn.modules.batchnorm._BatchNorm) and not norm.track_running_stats:
            norm.track_running_stats = True
            norm.register_buffer("running_mean", torch.zeros(norm.num_features))
            norm.register_buffer("running_var", torch.ones(norm.num_features))
            norm.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
    return model


def chunks(x: Tensor) -> Iterator[Tensor]:
    return (x[start : start + CHUNK] for start in range(0, len(x), CHUNK))


@torch.no_grad()
def predict(model: nn.Module, x: Tensor) -> Tensor:
    """Logits of `model` on `x`, with batch-norm statistics recomputed on `x` first (one cumulative
    average over all of it, as the evaluator recomputes static BN's)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
    if norms:
        model.train()
        for batch in chunks(x):
            model(batch)
    model.eval()
    return torch.cat([model(batch) for batch in chunks(x)])


def batch_order(size: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[Tensor]:
    """`steps` index batches of min(batch_size, size) entries, without repeats within a pass over a
    fresh permutation; the tail of a pass that would make a smaller batch is skipped."""
    batch_size = min(batch_size, size)
    order, position = torch.empty(0, dtype=torch.long), 0
    for _ in range(steps):
        if position + batch_size > len(order):
            order, position = torch.randperm(size, generator=generator), 0
        yield order[position : position + batch_size]
        position += batch_size


@dataclass(frozen=True)
class FedDFState(MethodState):
    aggregations: int = 0
    """Rounds aggregated so far (seeds each round's distillation batches)."""


@METHODS.register("feddf")
class FedDF(HeteroFL):
    Config = FedDFConfig
    State = FedDFState

    def __init__(self, config: FedDFConfig, resources: Resources) -> None:
        super().__init__(config, resources)
        if resources.unlabelled_x is None:
            raise ConfigError("data.server_fraction", 0.0, "a number in (0, 1): feddf distils on the server's share of the training data")
        self._teachers: dict[float, ScalableModel] = {}
        """One teacher model per width, built on first use and reloaded for every client."""
        self._student: ScalableModel | None = None

    def aggregate(self, global_state: StateDict, updates: list[ClientUpdate], state: FedDFState) -> tuple[StateDict, FedDFState]:
        averaged, state = super().aggregate(global_state, updates, state)
        state = replace(state, aggregations=state.aggregations + 1)
        if not updates:  # no teachers this round
            return averaged, state
        resources = self.resources
        seed = derive_seed(resources.seed, DISTILL_STREAM, state.aggregations, *sorted(u.client_id for u in updates))
        x = resources.unlabelled_x
        if 0 < self.config.distill_samples < len(x):
            pick = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[: self.config.distill_samples]
            x = x[pick.to(x.device)]
        x = x.to(resources.device)
        target = self.ensemble_logits(global_state, updates, x)
        student = self._student_model()
        student.load_state_dict(averaged, strict=True)
        self.distil(student, x, target, seed)
        distilled = student.state_dict()
        # Integer buffers (BN's batch counters) keep the clients' value; the rest is the student's.
        new = {
            key: distilled[key].detach().to(old.device, old.dtype, copy=True) if old.is_floating_point() else old
            for key, old in averaged.items()
        }
        return new, state

    def ensemble_logits(self, global_state: Mapping[str, Tensor], updates: list[ClientUpdate], x: Tensor) -> Tensor:
        """The plain mean of the client models' logits on `x` (AVGLOGITS); each client model is its
        update on top of what it received (tensors it held frozen are not sent back)."""
        total = None
        for update in updates:
            spec = update.spec
            width = self.width_of(spec)
            teacher = self._teacher_model(width)
            # Statistics are recomputed on x, so they may be missing here, whatever the norm.
            loaded = teacher.load_state_dict({**self.client_state(global_state, spec), **update.state}, strict=False)
            if loaded.unexpected_keys or not all(k.endswith(STATISTICS) for k in loaded.missing_keys):
                raise RuntimeError(f"client {update.client_id}'s state does not fit a width-{width} model: {loaded}")
            logits = predict(teacher, x)
            total = logits if total is None else total + logits
        return total / len(updates)

    def distil(self, student: nn.Module, x: Tensor, target: Tensor, seed: int) -> None:
        """Train `student` on (x, target logits) for `distill_steps` Adam steps, batches drawn from `seed`."""
        cfg = self.config
        if cfg.distill_steps == 0:
            return
        optimizer = torch.optim.Adam(student.parameters(), lr=cfg.distill_lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg.distill_steps)
        student.train()  # batch statistics, as the clients train
        losses = []
        # Global-RNG draws (dropout) are seeded by the round too, as a client's are.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            order = batch_order(len(x), cfg.distill_batch_size, cfg.distill_steps, torch.Generator().manual_seed(seed))
            for idx in order:
                idx = idx.to(x.device)
                loss = kl_distillation(student(x[idx]), target[idx], cfg.temperature)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(student.parameters(), MAX_GRAD_NORM)
                optimizer.step()
                schedule.step()
                losses.append(loss.detach())
        student.zero_grad(set_to_none=True)
        log.info("distilled %d steps: loss %.4f -> %.4f", cfg.distill_steps, float(losses[0]), float(losses[-1]))

    def _teacher_model(self, width: float) -> ScalableModel:
        if width not in self._teachers:
            self._teachers[width] = track_statistics(self.build(width)).to(self.resources.device)
        return self._teachers[width]

    def _student_model(self) -> ScalableModel:
        if self._student is None:
            self._student = self.build(self.model.width).to(self.resources.device)
        return self._student
