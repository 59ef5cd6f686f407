"""Distillation terms on a language model's (batch, classes, positions) logits are per position,
as its cross-entropy is, and unchanged on (batch, classes) logits; they are torch's KL divergence,
forward and backward, and vectorise over clients trained together."""

import warnings

import torch
import torch.nn.functional as F

from hfl.losses import kl_distillation, mutual_distillation


def test_distillation_of_sequences_is_the_mean_over_positions():
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(4, 7, 5, generator=gen), torch.randn(4, 7, 5, generator=gen)
    per_position = [kl_distillation(student[..., k], teacher[..., k], 2.0) for k in range(5)]
    torch.testing.assert_close(kl_distillation(student, teacher, 2.0), torch.stack(per_position).mean())
    mutual = [mutual_distillation([student[..., k], teacher[..., k]]) for k in range(5)]
    torch.testing.assert_close(mutual_distillation([student, teacher]), torch.stack(mutual).mean())


def test_distillation_of_one_prediction_per_sample_is_the_batch_mean_kl():
    gen = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(4, 7, generator=gen), torch.randn(4, 7, generator=gen)
    expected = F.kl_div(F.log_softmax(student, 1), F.log_softmax(teacher, 1), reduction="batchmean", log_target=True)
    assert torch.equal(kl_distillation(student, teacher), expected)


def test_distillation_is_torchs_kl_div_backward_too_and_vectorises_without_a_fallback():
    # The terms write kl_div out as the ops torch decomposes it into: the same gradients, bit for bit,
    # and torch.func.vmap's own batching rules (it has none for aten::kl_div and would loop over the
    # clients trained together, with a warning).
    gen = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(3, 4, 7, generator=gen, requires_grad=True), torch.randn(3, 4, 7, generator=gen, requires_grad=True)
    ours = torch.autograd.grad(kl_distillation(student[0], teacher[0], 2.0, detach_teacher=False), (student, teacher))
    log_student, log_teacher = F.log_softmax(student[0] / 2.0, 1), F.log_softmax(teacher[0] / 2.0, 1)
    theirs = torch.autograd.grad(F.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True) * 4.0, (student, teacher))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distilled = torch.func.vmap(lambda s, t: kl_distillation(s, t, 2.0))(student, teacher)
        mutual = torch.func.vmap(lambda s, t: mutual_distillation([s, t], 2.0))(student, teacher)
    torch.testing.assert_close(distilled, torch.stack([kl_distillation(s, t, 2.0) for s, t in zip(student, teacher)]))
    torch.testing.assert_close(mutual, torch.stack([mutual_distillation([s, t], 2.0) for s, t in zip(student, teacher)]))
