"""Distillation terms on a language model's (batch, classes, positions) logits are per position,
as its cross-entropy is, and unchanged on (batch, classes) logits."""

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
