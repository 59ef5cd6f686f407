"""Evaluation of the global model and of every sub-model a method defines.

Models trained with static batch norm (`model.norm=static_bn`, HeteroFL's sBN) keep no running
statistics; for evaluation they are recomputed from the training data, the global model's or the
sub-model's own, as HeteroFL does ("statistics recomputed for evaluation").

A model with early exits is scored at its deepest exit; every exit's accuracy and the accuracy of
their ensemble (the mean of the exits' softmax outputs, as DepthFL predicts) are reported beside it.

`fl.eval_mode=blockwise` runs the test set through the model one block at a time (FeDepth's
memory-efficient inference, `hfl.inference`); the scores are the same. Either way the peak memory
the inference needed is reported as `inference_peak_bytes`, measured the same way for both modes:
on the CPU the meter's cost was lost in the timing noise, so the standard mode is measured too.

Scores count targets, not samples: a language model's sample (a window of tokens) has a target at
every position, so `accuracy` is next-token accuracy over all positions and `loss` the mean
cross-entropy per token, with `perplexity` = exp(loss) beside them for text. An inference keeps the
logits of every sample it runs, which for text are (vocabulary x positions) per window, so the test
set runs in chunks whose logits take at most `OUTPUT_CHUNK_BYTES`: the whole set at once for every
image dataset here, a few thousand windows at a time for text; the peak is the largest chunk's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.data import TokenDataset
from hfl.experiment import ClientEnvironment, model_norm
from hfl.inference import blockwise_inference, standard_inference
from hfl.pruning.nsconv import load_masks
from hfl.seeding import SBN_STREAM, aside_from_torch_stream, derive_seed
from hfl.submodel.spec import SubmodelSpec
from hfl.types import StateDict

BATCH = 1024
OUTPUT_CHUNK_BYTES = 64 * 2**20
"""The most the logits of one inference over part of the test set may take (see the module docstring)."""


class Evaluator:
    """Scores state dicts on the test set; evaluation models are built once per sub-model shape."""

    def __init__(self, env: ClientEnvironment) -> None:
        self.env = env
        self.static_bn = model_norm(env.config) == "static_bn"
        self.text = isinstance(env.data, TokenDataset)
        self._models: dict[tuple, nn.Module] = {}

    def _model(self, spec: SubmodelSpec) -> nn.Module:
        if spec.shape not in self._models:
            # Static BN is evaluated with running statistics (recomputed below); other norms as trained.
            norm = "bn" if self.static_bn else None
            with aside_from_torch_stream():
                self._models[spec.shape] = self.env.method.client_model(spec, norm=norm).to(self.env.device)
        return self._models[spec.shape]

    def _train_inputs(self) -> Iterator[Tensor]:
        x, transform = self.env.train_x, self.env.transform
        wanted = self.env.config.fl.sbn_samples
        if 0 < wanted < len(x):  # the same seeded sample every evaluation
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(derive_seed(self.env.config.seed, SBN_STREAM)))
            x = x[order[:wanted].to(x.device)]
        for start in range(0, len(x), BATCH):
            batch = x[start : start + BATCH]
            yield batch if transform is None else transform(batch, train=False)

    @torch.no_grad()
    def _recompute_bn(self, model: nn.Module) -> None:
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if not norms:  # nothing to recompute (the GPT's layer norms keep no statistics)
            return
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None  # a cumulative average over all batches
        model.train()
        for batch in self._train_inputs():
            model(batch)

    @torch.no_grad()
    def scored_model(self, global_state: StateDict, spec: SubmodelSpec | None = None) -> nn.Module:
        """The (sub-)model `spec` selects as it is scored: weights from `global_state`, masks applied,
        static batch-norm statistics recomputed, in eval mode (`hfl.load_run` hands it to the user)."""
        spec = spec or SubmodelSpec()
        model = self._model(spec)
        model.load_state_dict(self.env.method.client_state(global_state, spec), strict=not self.static_bn)
        load_masks(model, spec.masks)
        if self.static_bn:
            self._recompute_bn(model)
        return model.eval()

    @torch.no_grad()
    def __call__(self, global_state: StateDict, spec: SubmodelSpec | None = None) -> dict[str, Any]:
        """Accuracy and mean cross-entropy per target on the test set of the (sub-)model `spec`
        selects, at its deepest exit; with several exits also `exit_accuracy` (by exit block) and
        `ensemble_accuracy`; for text also `perplexity`."""
        model = self.scored_model(global_state, spec)
        x, y = self.env.test_x, self.env.test_y
        names = [f"exit{b}" for b in model.exit_blocks] + (["head"] if model.head is not None else [])
        correct = torch.zeros(len(names) + 1, dtype=torch.long)  # each exit, then the ensemble
        loss, targets, peak = 0.0, 0, 0
        fl = self.env.config.fl
        # A sample's logits: classes x the targets it holds (positions, for text), at each exit.
        sample_bytes = 4 * self.env.data.num_classes * y[:1].numel() * len(names)
        chunk = max(BATCH, OUTPUT_CHUNK_BYTES // sample_bytes // BATCH * BATCH)
        for first in range(0, len(y), chunk):
            part_x = x[first : first + chunk]
            if fl.eval_mode == "blockwise":
                inference = blockwise_inference(model, part_x, BATCH, fl.eval_spill_dir or None)
            else:
                inference = standard_inference(model, part_x, BATCH)
            peak = max(peak, inference.peak_bytes)
            part_y = y[first : first + chunk]
            for start in range(0, len(part_y), BATCH):  # the batches of the standard forward: the same sums
                outputs = [o[start : start + BATCH] for o in inference.outputs]
                target = part_y[start : start + BATCH]
                loss += float(F.cross_entropy(outputs[-1], target, reduction="sum"))
                targets += target.numel()
                ensemble = torch.stack([o.softmax(1) for o in outputs]).mean(0)
                for k, logits in enumerate([*outputs, ensemble]):
                    correct[k] += int((logits.argmax(1) == target).sum())
            del inference
        accuracy = (correct.double() / targets).tolist()
        scores: dict[str, Any] = {"accuracy": accuracy[-2], "loss": loss / targets, "inference_peak_bytes": peak}
        if self.text:
            scores["perplexity"] = math.exp(scores["loss"]) if scores["loss"] < 700 else math.inf  # exp overflows past ~709
        if len(names) > 1:
            scores["exit_accuracy"] = dict(zip(names, accuracy[:-1]))
            scores["ensemble_accuracy"] = accuracy[-1]
        return scores
