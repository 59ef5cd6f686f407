"""Client training under `lightning.Trainer`: one client-round as a LightningModule, the Trainer
settings under which it trains as hfl trains it, and a client-round you fit with your own Trainer.

Imported only where Lightning trains (`backend.trainer=lightning`, `fl.callbacks`, or your own
Trainer): the import costs a second or more and about 250 MiB in every process that loads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from hfl.client import ClientBatches, ClientModule, adaptively_clipped, clip_adaptively, client_extras, finish_client, load_client
from hfl.methods.base import Method
from hfl.optim import ClientOptimizer
from hfl.registry import import_class
from hfl.types import ClientTask, ClientUpdate, StateDict, TrainSettings

log = logging.getLogger(__name__)
_quieted = False


class ClientLightningModule(L.LightningModule):
    """One client-round as a LightningModule: `training_step` is the method's objective,
    `configure_optimizers` the client's optimiser, `on_train_batch_end` keeps pruned entries zero.
    It holds the client module (`client`), so a Trainer's device moves and train/eval modes reach
    the model, the peers and the loss it accumulates."""

    def __init__(self, client: ClientModule) -> None:
        super().__init__()
        self.client = client

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.client.training_step(batch, batch_idx)

    def configure_optimizers(self) -> ClientOptimizer:
        return self.client.configure_optimizers()

    def on_train_batch_end(self, *args: object) -> None:
        self.client.on_train_batch_end(*args)

    def configure_gradient_clipping(self, optimizer: ClientOptimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """`fl.agc` first (on unscaled gradients: the precision plugin unscales before this hook), then
        the Trainer's own clipping, in the fast driver's order."""
        agc = self.client.task.ctx.train.agc
        if agc > 0:
            clip_adaptively(adaptively_clipped((self.client.model, *self.client.peers)), agc)
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm)


def trainer_settings(settings: TrainSettings, device: torch.device) -> dict[str, Any]:
    """The `lightning.Trainer` arguments under which a client trains as hfl trains it: its epochs,
    precision, gradient clipping and accumulation and callbacks, and nothing logged, checkpointed,
    summarised or shown (hfl records the client-round itself)."""
    return {
        "max_epochs": settings.local_epochs,
        "accelerator": "gpu" if device.type == "cuda" else "cpu",
        "devices": 1,
        "precision": settings.precision,
        "gradient_clip_val": settings.gradient_clip_val or None,
        "gradient_clip_algorithm": settings.gradient_clip_algorithm,
        "accumulate_grad_batches": settings.accumulate_grad_batches,
        "callbacks": [import_class(path, "fl.callbacks")() for path in settings.callbacks],
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }


def quiet_lightning() -> None:
    """Lightning announces its set-up (accelerators, tips, why fit stopped) at INFO on every Trainer,
    which is every client-round here: show its loggers from WARNING up, once per process, unless
    you set their level yourself (Lightning's own default is INFO)."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        if logger.level in (logging.NOTSET, logging.INFO):
            logger.setLevel(logging.WARNING)
    log.info("clients train under lightning.Trainer; its set-up messages are shown from WARNING up")


def fit_lightning(module: ClientModule, batches: ClientBatches, epochs: int) -> None:
    """Train `module` for `epochs` under a `lightning.Trainer` set up by `trainer_settings`."""
    quiet_lightning()
    device = module.device_of_model()
    trainer = L.Trainer(**{**trainer_settings(module.task.ctx.train, device), "max_epochs": epochs})
    trainer.fit(ClientLightningModule(module), train_dataloaders=batches)


class LightningClient:
    """One client-round to fit with your own `lightning.Trainer` (`ClientEnvironment.lightning_client`):
    the sub-model loaded from the global state, `module` (a LightningModule) and `batches` (the
    client's data). Fit once per stage of `stages()` (most methods train in one stage), with the
    arguments of `trainer_settings()` for the numbers hfl's own drivers give; `update()` then returns
    what the client sends back. From construction to `update()`, torch's global generator is the
    client-round's, seeded as hfl seeds it, and afterwards it is restored."""

    def __init__(
        self,
        model: nn.Module,
        method: Method,
        task: ClientTask,
        global_state: StateDict,
        batches: ClientBatches,
        classes: Tensor | None = None,
        peer: Callable[[], nn.Module] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> None:
        self.task, self.batches = task, batches
        self._started = time.perf_counter()
        self._received = load_client(model, method, task, global_state)
        self._metrics = metrics or {}
        self._rng_state = torch.get_rng_state()
        torch.manual_seed(task.ctx.seed_for(0))  # as train_client seeds the client-round
        self.client = ClientModule(model, method, task, classes, peer)
        self.module = ClientLightningModule(self.client)

    def trainer_settings(self) -> dict[str, Any]:
        """`lightning.Trainer` arguments that train this client as hfl does (add your own callbacks)."""
        return trainer_settings(self.task.ctx.train, self.client.device_of_model())

    def stages(self) -> Iterator[int]:
        """Enter each of the task's training stages in turn (FeDepth's block groups, m-FeDepth's
        peers; one stage for most methods): fit the module once per stage."""
        for stage, trainable in enumerate(self.task.stages):
            self.client.enter_stage(stage, trainable)
            yield stage

    def update(self) -> ClientUpdate:
        """What the client sends back after its fits, with the client-round's metrics."""
        extras = client_extras(self.client, self.batches)
        torch.set_rng_state(self._rng_state)
        update = finish_client(self.client, self._received, extras, None, time.perf_counter() - self._started)
        update.metrics.update(self._metrics)
        return update
