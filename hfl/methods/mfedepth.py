"""m-FeDepth — the multi-model variant of FeDepth (Zhang, Dai, Wang, Xing, Chen and Sun, AAAI 2024,
arXiv:2303.04887). A client whose budget has surplus memory for M > 1 models trains M of them with
mutual knowledge distillation, mean cross-entropy plus 1/(M-1) sum over ordered pairs of
KL(h^m' || h^m), and uploads one; other clients train as FeDepth's.

Deliberate choices: the peers start every client-round from fresh seeded initialisations and are
discarded after it (`ClientTask.peers`): copies of the global model trained on the same batches would
stay identical (the distillation term has zero gradient there), and mutual learning trains
differently initialised students. The model that started from the global weights is the one
uploaded. M is the largest number of models, up to `max_models`, that the budget holds in the very
groups one model trains, every block trained: memory to spare beyond FeDepth's schedule (the paper's
Surplus scenario, where "1/4 of clients with sufficient memory can apply MKD"; a budget that holds
two models only in finer groups trains one).
"""

from __future__ import annotations

from dataclasses import dataclass

from hfl.methods.fedepth import FeDepth, FeDepthConfig
from hfl.registry import METHODS


@dataclass(frozen=True)
class MFeDepthConfig(FeDepthConfig):
    name: str = "mfedepth"
    max_models: int = 2
    """Most models a client trains with mutual distillation; the budget decides how many fit."""


@METHODS.register("mfedepth")
class MFeDepth(FeDepth):
    Config = MFeDepthConfig
