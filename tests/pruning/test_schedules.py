import pytest

from hfl.pruning.schedules import (
    adjustment_count,
    extrusion_learning_rate,
    feddst_adjustment_rate,
    fedmef_adjustment_rate,
    rex_factor,
)


@pytest.mark.parametrize("step, expected", [(0, 1.0), (25, 0.857143), (50, 0.666667), (75, 0.4), (100, 0.0)])
def test_rex_factor_from_the_issue(step, expected):
    assert rex_factor(step, 100) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("round_index, expected", [(10, 0.398904), (100, 0.3), (150, 0.2), (200, 0.1), (300, 0.0), (301, 0.0), (450, 0.0)])
def test_fedmef_adjustment_rate_from_the_issue(round_index, expected):
    assert fedmef_adjustment_rate(round_index, 300) == pytest.approx(expected, abs=1e-6)


def test_feddst_rate_is_half_alpha_at_mid_training_and_zero_after_the_end():
    assert feddst_adjustment_rate(0, 0.2, 100) == pytest.approx(0.2)
    assert feddst_adjustment_rate(50, 0.2, 100) == pytest.approx(0.1)
    assert feddst_adjustment_rate(100, 0.2, 100) == pytest.approx(0.0, abs=1e-12)
    assert feddst_adjustment_rate(150, 0.2, 100) == 0.0


def test_adjustment_count_rounds_down():
    assert adjustment_count(0.3, 10) == 3
    assert adjustment_count(0.398904, 10) == 3
    assert adjustment_count(0.05, 10) == 0


def test_extrusion_lr_is_the_larger_of_the_schedule_and_the_budgeted_rate():
    # σ(0) = 0.5: a vanished θ_low gives β = 0 and the schedule's rate stands.
    assert extrusion_learning_rate(0.01, 1.0, 0, 100, 0.0) == 0.01
    # ‖θ_low‖ = ln 3: 2σ − 1 = 0.5; p(50) = 2/3; β = 1/3 > 0.01.
    assert extrusion_learning_rate(0.01, 1.0, 50, 100, 1.0986122886681098) == pytest.approx(1 / 3)
