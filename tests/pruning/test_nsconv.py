import math

import pytest
import torch
import torch.nn.functional as F

from hfl.pruning.nsconv import (
    RELU_GAMMA,
    NSConv2d,
    applied_weights,
    effective_weight,
    load_masks,
    normalize_convolutions,
    standardized_filters,
)
from hfl.pruning.sap import ActivationPrunedNSConv2d, prune_activations

FILTER = torch.tensor([1.0, 2.0, 3.0, 100.0]).view(1, 4, 1, 1)  # c_out 1, c_in 4, 1×1 kernel
MASK = torch.tensor([True, True, True, False]).view(1, 4, 1, 1)


def test_issue_example():
    # kept [1, 2, 3]: μ = 2, population σ = √(2/3), z = ±√1.5; c_in is the 3 kept entries, so
    # θ̂ = √3·z = ±2.121 and the applied weight θ̂/3 = ±0.7071; the pruned 100 is ignored
    theta_hat = standardized_filters(FILTER, MASK, gamma=1.0).flatten()
    torch.testing.assert_close(theta_hat, torch.tensor([-2.121320, 0.0, 2.121320, 0.0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(effective_weight(FILTER, MASK, gamma=1.0).flatten(), torch.tensor([-0.707107, 0.0, 0.707107, 0.0]), atol=1e-4, rtol=0)


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


def conv_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 3, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(3, 2, 1, bias=False))


def test_normalize_convolutions_keeps_state_and_load_masks_sets_each_layers_mask():
    model = conv_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    normalize_convolutions(model, gamma=1.0)
    assert all(type(m) is NSConv2d for m in (model[0], model[2]))
    assert model.state_dict().keys() == state.keys()
    mask = torch.rand(3, 4, 3, 3) > 0.5
    load_masks(model, {"0.weight": mask})
    assert torch.equal(model[0].mask, mask) and model[2].mask.all()  # no mask given: all kept
    x = torch.randn(2, 4, 5, 5)
    hidden = F.relu(F.conv2d(x, effective_weight(state["0.weight"], mask, 1.0), state["0.bias"], padding=1))
    torch.testing.assert_close(model(x), F.conv2d(hidden, effective_weight(state["2.weight"], torch.ones(2, 3, 1, 1, dtype=torch.bool), 1.0)))


def test_activation_pruned_nsconv_applies_the_effective_weight_with_gradients_through_it():
    plain, pruned = conv_model(), conv_model()
    for model in (plain, pruned):
        normalize_convolutions(model)
        load_masks(model, {"0.weight": torch.arange(108).view(3, 4, 3, 3) % 3 > 0})
    prune_activations(pruned, 0.0)  # keep every input entry: the gradients must be NSConv's exactly
    assert type(pruned[0]) is ActivationPrunedNSConv2d
    x = torch.randn(2, 4, 5, 5)
    torch.testing.assert_close(pruned(x), plain(x))
    plain(x).square().sum().backward()
    pruned(x).square().sum().backward()
    for a, b in zip(plain.parameters(), pruned.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


def test_applied_weights_give_the_dense_gradient_the_stored_weights_mask():
    model = normalize_convolutions(conv_model())
    mask = torch.arange(108).view(3, 4, 3, 3) % 3 > 0
    load_masks(model, {"0.weight": mask})
    x = torch.randn(2, 4, 5, 5)
    (stored,) = torch.autograd.grad(model(x).sum(), [model[0].weight])
    assert not stored[~mask].any()  # the standardisation masks the stored weight's gradient
    with applied_weights(model) as applied:
        torch.testing.assert_close(model(x), model(x).detach())
        (dense,) = torch.autograd.grad(model(x).sum(), [applied["0.weight"]])
    assert dense[~mask].abs().min() > 0  # pruned entries get a gradient to grow by
    assert model[0].held_weight is None


def reference_effective_weight(weight, mask, gamma):
    """Eq. 7 over c_in (each filter's kept entries) written out, differentiated by autograd."""
    flat, keep = weight.flatten(1), mask.flatten(1).to(weight.dtype)
    count = keep.sum(1, keepdim=True)
    mean = (flat * keep).sum(1, keepdim=True) / count
    sigma = torch.sqrt((((flat - mean) * keep) ** 2).sum(1, keepdim=True) / count + 1e-5)
    return (gamma * count.sqrt() * (flat - mean) / sigma * keep).view_as(weight) / count.view(-1, 1, 1, 1)


def test_the_written_out_backward_is_autograds_through_the_formula():
    weight = torch.randn(3, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 4, 3, 3) > 0.6
    grad = torch.randn(3, 4, 3, 3, dtype=torch.float64)
    (expected,) = torch.autograd.grad(reference_effective_weight(weight, mask, 1.3), weight, grad)
    (written,) = torch.autograd.grad(effective_weight(weight, mask, 1.3), weight, grad)
    torch.testing.assert_close(written, expected)
    torch.testing.assert_close(effective_weight(weight, mask, 1.3), reference_effective_weight(weight, mask, 1.3))
    assert torch.autograd.gradcheck(lambda w: effective_weight(w, mask, 1.3), (weight,))


@pytest.mark.parametrize("density", [1.0, 0.5, 0.1, 0.05])
def test_output_variance_is_gamma_squared_times_the_inputs_second_moment_at_every_density(density):
    """Theorem 1: an NSConv maps inputs of mean μ_f, variance σ_f² to outputs of mean 0 and variance
    γ²(σ_f² + μ_f²), for a 3×3 kernel and at any density (c_in is a filter's kept entries; read as
    the filter's size, 16·3·3, the variance would shrink by the density: 0.94, 0.47, 0.09, 0.04 of
    it). Centred inputs: the theorem's μ_f² comes from random weights; filters standardised to mean
    0 cancel it."""
    generator = torch.Generator().manual_seed(0)
    conv = NSConv2d(16, 64, 3, bias=False, gamma=1.5)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator) * 0.3 + 0.1)
        conv.set_mask(torch.rand(conv.weight.shape, generator=generator) < density)
        x = torch.randn(8, 16, 24, 24, generator=generator) * 0.8  # σ_f² + μ_f² = 0.64
        out = conv(x)
    assert abs(float(out.mean())) < 0.05
    assert float(out.var()) == pytest.approx(1.5**2 * 0.64, rel=0.1)


def test_the_learnable_gain_scales_each_filter_and_its_gradient_is_autograds():
    weight = torch.randn(3, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    gain = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 4, 3, 3) > 0.6
    grad = torch.randn(3, 4, 3, 3, dtype=torch.float64)
    reference = reference_effective_weight(weight, mask, 1.3) * gain.view(-1, 1, 1, 1)
    torch.testing.assert_close(effective_weight(weight, mask, 1.3, gain), reference)
    expected = torch.autograd.grad(reference, (weight, gain), grad)
    written = torch.autograd.grad(effective_weight(weight, mask, 1.3, gain), (weight, gain), grad)
    for a, b in zip(written, expected):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda w, g: effective_weight(w, mask, 1.3, g), (weight, gain))


def test_affine_nsconv_adds_a_gain_and_bias_per_filter_that_train_also_under_sap():
    plain, pruned = conv_model(), conv_model()
    for model in (plain, pruned):
        normalize_convolutions(model, affine=True)
        load_masks(model, {"0.weight": torch.arange(108).view(3, 4, 3, 3) % 3 > 0})
    state = plain.state_dict()
    torch.testing.assert_close(state["0.gain"], torch.ones(3))
    torch.testing.assert_close(state["2.gain"], torch.ones(2))
    torch.testing.assert_close(state["2.bias"], torch.zeros(2))  # added where the conv had none
    with torch.no_grad():
        for model in (plain, pruned):
            model[0].gain.copy_(torch.tensor([0.5, 1.0, 2.0]))
            model[2].bias.copy_(torch.tensor([0.3, -0.3]))
    prune_activations(pruned, 0.0)
    x = torch.randn(2, 4, 5, 5)
    hidden = F.relu(F.conv2d(x, effective_weight(state["0.weight"], model[0].mask, RELU_GAMMA) * torch.tensor([0.5, 1.0, 2.0]).view(-1, 1, 1, 1), state["0.bias"], padding=1))
    torch.testing.assert_close(plain(x), F.conv2d(hidden, effective_weight(state["2.weight"], torch.ones(2, 3, 1, 1, dtype=torch.bool)), torch.tensor([0.3, -0.3])))
    torch.testing.assert_close(pruned(x), plain(x))
    plain(x).square().sum().backward()
    pruned(x).square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), pruned.parameters()):
        assert a.grad.abs().sum() > 0, name
        torch.testing.assert_close(b.grad, a.grad)
