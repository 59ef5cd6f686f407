"""The evaluator's sums: per target, so a language model is scored per token (accuracy over every
position, mean cross-entropy per token, perplexity) and an image model per sample."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hfl.data import TokenDataset
from hfl.evaluation import Evaluator
from tests.conftest import small_config

VOCAB = 4


class RepeatLast(nn.Module):
    """Predicts that the next token repeats the current one: logits 5 for it, 0 for the others."""

    exit_blocks = ()
    head = nn.Identity()

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        return 5.0 * F.one_hot(x, VOCAB).float().transpose(1, 2)  # (batch, vocab, sequence)


def test_language_model_scores_count_tokens_not_windows():
    # One client's test text 1 1 2 2 2 3, windows of 2: x 11 12 22 22, targets 12 22 22 23.
    tokens = torch.tensor([1, 1, 2, 2, 2, 3], dtype=torch.uint8)
    spans = torch.tensor([[0, 6]])
    data = TokenDataset("hand", tokens, ("a",), spans, spans, seq_len=2, num_classes=VOCAB)
    model = RepeatLast()
    env = SimpleNamespace(config=small_config(), data=data, device=torch.device("cpu"), test_x=data.test_x, test_y=data.test_y,
                          method=SimpleNamespace(client_model=lambda spec, norm=None: model, client_state=lambda state, spec: state))
    scores = Evaluator(env)(model.state_dict())
    # Repeating the current token is right at 5 of the 8 positions: 1|1, 2|2, 2|2, 2|2, 2|2 (x|target).
    assert scores["accuracy"] == 5 / 8
    right, wrong = math.log(math.exp(5) + VOCAB - 1) - 5, math.log(math.exp(5) + VOCAB - 1)
    assert scores["loss"] == pytest.approx((5 * right + 3 * wrong) / 8, rel=1e-6)
    assert scores["perplexity"] == pytest.approx(math.exp(scores["loss"]), rel=1e-12)
