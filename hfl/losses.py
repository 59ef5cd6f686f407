"""Distillation losses that several methods share (FjORD, DepthFL, ScaleFL, FedDF, FeDepth)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def kl_distillation(student: Tensor, teacher: Tensor, temperature: float = 1.0, detach_teacher: bool = True) -> Tensor:
    """Hinton et al.'s distillation term: T^2 KL(softmax(teacher / T) || softmax(student / T)),
    averaged over the batch (and over the positions of a language model's (batch, classes,
    positions) logits, as its cross-entropy is); the teacher's logits are a constant target unless
    `detach_teacher` is off (ScaleFL's authors let gradients flow through the deepest exit)."""
    teacher = teacher.detach() if detach_teacher else teacher
    log_student = F.log_softmax(student / temperature, dim=1)
    log_teacher = F.log_softmax(teacher / temperature, dim=1)
    return _batchmean_kl(log_student, log_teacher) * temperature**2 / _positions(student)


def _batchmean_kl(log_student: Tensor, log_teacher: Tensor) -> Tensor:
    """`F.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True)` written out as
    the ops torch decomposes it into (the same floats, forward and backward): `torch.func.vmap` has
    no batching rule for `aten::kl_div` and would loop over the clients trained together."""
    return (log_teacher.exp() * (log_teacher - log_student)).sum() / log_student.shape[0]


def _positions(logits: Tensor) -> int:
    """Predictions per sample: 1 for (batch, classes) logits, the positions of (batch, classes, ...)."""
    return logits[:1, :1].numel()


def mutual_distillation(logits: list[Tensor], temperature: float = 1.0) -> Tensor:
    """DepthFL's self-distillation (and m-FeDepth's mutual learning): sum over classifiers i of
    (1/(n-1)) sum_{j != i} KL(p_j || p_i), p = softmax(logits / T), teachers p_j detached, each KL a
    batch mean (and a mean over positions for a language model), scaled by T^2."""
    n = len(logits)
    if n < 2:
        raise ValueError("mutual distillation needs at least two classifiers")
    log_probs = [F.log_softmax(z / temperature, dim=1) for z in logits]
    total = logits[0].new_zeros(())
    for i, student in enumerate(log_probs):
        for j, teacher in enumerate(log_probs):
            if i != j:
                total = total + _batchmean_kl(student, teacher.detach())
    return total * temperature**2 / (n - 1) / _positions(logits[0])


def mutual_learning_loss(logits: Sequence[Tensor], y: Tensor, temperature: float = 1.0) -> dict[str, Tensor]:
    """m-FeDepth's objective: the models' mean cross-entropy plus 1/(M-1) sum over ordered pairs
    m != m' of KL(h^m' || h^m), each model learning from the others' detached predictions; plain
    cross-entropy for one model (FeDepth)."""
    ce = torch.stack([F.cross_entropy(z, y) for z in logits]).mean()
    if len(logits) == 1:
        return {"loss": ce}
    distill = mutual_distillation(list(logits), temperature)
    return {"loss": ce + distill, "ce": ce.detach(), "distillation": distill.detach()}


SCALEFL_LOSSES = ("authors", "slides")
"""The forms of `self_distillation_loss`: the ScaleFL authors' code's, or the paper slides'."""


def self_distillation_loss(
    outputs: Sequence[Tensor], y: Tensor, alpha: float, temperature: float, detach_teacher: bool = False,
    form: str = "authors", kl_reduction: str = "mean",
) -> dict[str, Tensor]:
    """ScaleFL's objective over the exits 1..j of a level-j model (shallowest first), KL_i between
    exit i and the deepest exit j:
    'authors': L = sum_i i (CE(y_i, y) + alpha KL_tau(y_i, y_j)) / (j(j+1)/2);
    'slides':  L = sum_i i (alpha KL_tau(y_i, y_j) + (1 - alpha) CE(y_i, y)) / (j(j+1)).
    KL is per sample (`kl_reduction=batchmean`) or also averaged over the classes ('mean')."""
    j = len(outputs)
    teacher = outputs[-1]
    ce = torch.stack([F.cross_entropy(logits, y) for logits in outputs])
    per_class = outputs[0].shape[1] if kl_reduction == "mean" else 1
    # The deepest exit's KL with itself is 0; it is left out rather than computed.
    kl = torch.stack([kl_distillation(logits, teacher, temperature, detach_teacher) / per_class for logits in outputs[:-1]]
                     + [ce.new_zeros(())])
    weights = torch.arange(1, j + 1, dtype=ce.dtype, device=ce.device)
    if form == "authors":
        loss = (weights * (ce + alpha * kl)).sum() / (j * (j + 1) / 2)
    else:
        loss = (weights * (alpha * kl + (1 - alpha) * ce)).sum() / (j * (j + 1))
    return {"loss": loss, "ce": ce.detach().mean(), "kl": kl[:-1].detach().mean() if j > 1 else kl[0].detach()}
