"""Evaluation of the global model and of every sub-model a method defines.

Models trained with static batch norm (`model.norm=static_bn`, HeteroFL's sBN) keep no running
statistics; for evaluation they are recomputed from the training data, the global model's or the
sub-model's own, as HeteroFL does ("statistics recomputed for evaluation").
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.backends.base import ClientEnvironment, build_model_for, model_norm
from hfl.models import ScalableModel
from hfl.submodel.spec import SubmodelSpec, extract
from hfl.types import StateDict

BATCH = 1024


class Evaluator:
    """Scores state dicts on the test set; evaluation models are built once per sub-model shape."""

    def __init__(self, env: ClientEnvironment) -> None:
        self.env = env
        self.static_bn = model_norm(env.config) == "static_bn"
        self._models: dict[tuple[float, frozenset[int]], ScalableModel] = {}

    def _model(self, spec: SubmodelSpec) -> ScalableModel:
        width = self.env.config.model.width if spec.width is None else spec.width
        key = (width, spec.dropped_blocks)
        if key not in self._models:
            # Running statistics always exist at evaluation: loaded, or recomputed for static BN.
            model = build_model_for(self.env.config, self.env.data, width, norm="bn")
            model.drop_blocks(spec.dropped_blocks)
            self._models[key] = model.to(self.env.device)
        return self._models[key]

    def _train_inputs(self) -> Iterator[Tensor]:
        x, transform = self.env.train_x, self.env.transform
        for start in range(0, len(x), BATCH):
            batch = x[start : start + BATCH]
            yield batch if transform is None else transform(batch, train=False)

    @torch.no_grad()
    def _recompute_bn(self, model: nn.Module) -> None:
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None  # a cumulative average over all batches
        model.train()
        for batch in self._train_inputs():
            model(batch)

    @torch.no_grad()
    def __call__(self, global_state: StateDict, spec: SubmodelSpec | None = None) -> dict[str, float]:
        """Accuracy and mean cross-entropy on the test set of the (sub-)model `spec` selects."""
        spec = spec or SubmodelSpec()
        model = self._model(spec)
        model.load_state_dict(extract(global_state, spec), strict=not self.static_bn)
        if self.static_bn:
            self._recompute_bn(model)
        model.eval()
        x, y = self.env.test_x, self.env.test_y
        correct, loss = 0, 0.0
        for start in range(0, len(y), BATCH):
            logits = model(x[start : start + BATCH])
            target = y[start : start + BATCH]
            loss += float(F.cross_entropy(logits, target, reduction="sum"))
            correct += int((logits.argmax(1) == target).sum())
        return {"accuracy": correct / len(y), "loss": loss / len(y)}
