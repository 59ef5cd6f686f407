import math

import pytest
import torch
import torch.nn.functional as F

from hfl.pruning.nsconv import (
    RELU_GAMMA,
    NSConv2d,
    effective_weight,
    standardized_filters,
)

FILTER = torch.tensor([1.0, 2.0, 3.0, 100.0]).view(1, 4, 1, 1)  # c_out 1, c_in 4, 1×1 kernel
MASK = torch.tensor([True, True, True, False]).view(1, 4, 1, 1)


def test_issue_example():
    # kept [1, 2, 3]: μ = 2, population σ = √(2/3); √c_in = 2 → ±2·√1.5 = ±2.449; the pruned 100 is ignored
    theta_hat = standardized_filters(FILTER, MASK, gamma=1.0).flatten()
    torch.testing.assert_close(theta_hat, torch.tensor([-2.449490, 0.0, 2.449490, 0.0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(effective_weight(FILTER, MASK, gamma=1.0).flatten(), torch.tensor([-0.612372, 0.0, 0.612372, 0.0]), atol=1e-4, rtol=0)


def test_filters_are_standardised_one_by_one():
    weight = torch.cat([FILTER, 10 * FILTER + 7])
    mask = torch.cat([MASK, MASK])
    theta_hat = standardized_filters(weight, mask, gamma=1.0)
    torch.testing.assert_close(theta_hat[0], theta_hat[1], atol=1e-4, rtol=0)


def test_default_gamma_is_the_relu_gain():
    assert RELU_GAMMA == pytest.approx(math.sqrt(2 / (1 - 1 / math.pi)))
    torch.testing.assert_close(standardized_filters(FILTER, MASK), RELU_GAMMA * standardized_filters(FILTER, MASK, gamma=1.0))


def test_nsconv_convolves_with_the_effective_weight_and_keeps_conv_state_keys():
    conv = NSConv2d(4, 1, 1, bias=False, gamma=1.0)
    with torch.no_grad():
        conv.weight.copy_(FILTER)
    conv.set_mask(MASK)
    x = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(conv(x), F.conv2d(x, effective_weight(FILTER, MASK, gamma=1.0)))
    assert list(conv.state_dict()) == ["weight"]
