"""FLOPs of attention on the CPU: torch's formula for its CUDA kernels, registered for the CPU kernel
(`hfl.accounting.flops`), so a GPT's counted FLOPs include attention on every device."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hfl.accounting.cost import measure_training_cost
from hfl.accounting.flops import CPU_ATTENTION, FlopCounterMode, FlopCountingTracker
from hfl.accounting.memory import LiveStorageTracker
from hfl.models.gpt import GPT


def test_one_cpu_attention_call_costs_the_hand_formula():
    b, h, s, d = 2, 3, 10, 4
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert CPU_ATTENTION in counter.get_flop_counts()["Global"]  # the fused CPU kernel ran, and it counted
    assert counter.get_total_flops() == 4 * b * h * s * s * d  # QK^T and the product with V, 2 FLOPs per multiply-add
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    assert counter.get_total_flops() == 10 * b * h * s * s * d  # the scores again, then the gradients of V, the scores, Q and K


def test_gpt_forward_flops_are_its_linear_layers_and_its_attention():
    s, heads, dim = 10, 3, 12
    model = GPT(20, dim=dim, depth=1, heads=heads, context=16)
    cost = measure_training_cost(model, (s,), 20, 4, input_dtype=torch.int64)
    linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    assert cost.forward_flops_per_sample == 2 * s * linear + 4 * heads * s * s * (dim // heads)
    assert cost.input_bytes == 4 * (8 * s + 8 * s)  # int64 ids and a target id per position


def test_the_counting_tracker_counts_and_tracks_what_torchs_counter_inside_the_tracker_does():
    """One dispatch mode for both (`FlopCountingTracker`): the FLOPs torch's counter counts, and the
    same timeline as the live-storage tracker with torch's counter entered inside it (whose
    decompositions the tracker then sees); nothing is counted while `counting` is off."""
    torch.manual_seed(0)
    models = [(GPT(20, dim=12, depth=2, heads=3, context=16), torch.randint(0, 20, (2, 10))),
              (nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 5)), torch.randn(2, 3, 8, 8))]
    for model, x in models:
        with LiveStorageTracker(record=True) as pair, FlopCounterMode(display=False) as counter:
            model(x).sum().backward()
        model.zero_grad(set_to_none=True)  # as before the pair: the backward pass allocates the gradients
        with FlopCountingTracker() as one:
            one.counting = True
            model(x).sum().backward()
            one.counting = False
            model(x).sum().backward()
        assert one.flops == counter.get_total_flops() > 0
        assert one.timeline[: len(pair.timeline)] == pair.timeline and len(one.timeline) > len(pair.timeline)
