"""Schedules of dynamic sparse training: how much of the mask changes in a round, and FedMef's
budgeted learning rate for the extrusion phase."""

from __future__ import annotations

import math


def fedmef_adjustment_rate(round_index: int, stop_round: int) -> float:
    """FedMef's (and FedTiny's) ζ_r = 0.2·(1 + cos(r·π / R_stop)): the fraction of each layer's
    active weights replaced at round r; 0 after R_stop, when the mask stops changing."""
    if round_index > stop_round:
        return 0.0
    return 0.2 * (1.0 + math.cos(round_index * math.pi / stop_round))


def feddst_adjustment_rate(round_index: int, alpha: float, end_round: int) -> float:
    """FedDST's α_r = α/2·(1 + cos(r·π / r_end)): the fraction of kept weights a client prunes and
    regrows at a readjustment in round r; 0 after r_end."""
    if round_index > end_round:
        return 0.0
    return alpha / 2.0 * (1.0 + math.cos(round_index * math.pi / end_round))


def adjustment_count(rate: float, active: int) -> int:
    """ξ = ζ·n_l weights to replace in a layer with n_l active ones, rounded down: a layer never
    swaps more than the rate allows, and a rate below 1/n_l leaves it as it is."""
    return math.floor(rate * active)


def rex_factor(step: int, budget: int) -> float:
    """The REX schedule's p(t) = (2T − 2t) / (2T − t), from 1 at t = 0 to 0 at t = T."""
    if not 0 <= step <= budget or budget <= 0:
        raise ValueError(f"step must lie in [0, budget] with budget > 0, got step {step}, budget {budget}")
    return (2 * budget - 2 * step) / (2 * budget - step)


def extrusion_learning_rate(lr: float, initial_lr: float, step: int, budget: int, low_norm: float) -> float:
    """FedMef's Eq. 3–4: μ_t = max(η_t, β_t) with β_t = p(t)·(2σ(‖θ_low‖) − 1)·η_0, so extrusion
    keeps a useful rate late in training and slows as the marked weights shrink."""
    scale = 2.0 / (1.0 + math.exp(-low_norm)) - 1.0
    return max(lr, rex_factor(step, budget) * scale * initial_lr)
