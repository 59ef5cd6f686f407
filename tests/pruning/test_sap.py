import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hfl.accounting.cost import SavedTensorMeter, measure_training_cost
from hfl.models import build_model
from hfl.pruning.sap import (
    ActivationPrunedConv2d,
    ActivationPrunedLinear,
    kept_entries,
    prune_activations,
)

S = 0.75


def top_masked(x, sparsity):
    """x with all but its ⌊(1 − s)·numel⌋ largest-magnitude entries zeroed, by sorting."""
    k = kept_entries(x.numel(), sparsity)
    threshold = x.abs().flatten().sort(descending=True).values[k - 1]
    return x * (x.abs() >= threshold)


def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


@pytest.mark.parametrize("layer, shape", [(nn.Conv2d(3, 4, 3, padding=1, stride=2), (2, 3, 6, 6)), (nn.Linear(6, 5), (2, 3, 6))])
def test_forward_dense_grad_x_exact_grad_w_from_the_masked_input(layer, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, requires_grad=True)
    dense = copy.deepcopy(layer)
    pruned = prune_activations(copy.deepcopy(layer), S)
    out_dense, out_pruned = dense(x), pruned(x)
    torch.testing.assert_close(out_pruned, out_dense)
    grad_out = torch.randn_like(out_dense)
    (grad_x_dense,) = torch.autograd.grad(out_dense, x, grad_out)
    grad_x, grad_w, grad_b = torch.autograd.grad(out_pruned, (x, pruned.weight, pruned.bias), grad_out)
    torch.testing.assert_close(grad_x, grad_x_dense)
    # by hand: the dense layer's weight gradient at the input with all but the top entries zeroed
    masked = top_masked(x.detach(), S)
    assert int((masked != 0).sum()) == kept_entries(x.numel(), S)
    hand = copy.deepcopy(layer)
    hand_w, hand_b = torch.autograd.grad(hand(masked), (hand.weight, hand.bias), grad_out)
    torch.testing.assert_close(grad_w, hand_w)
    torch.testing.assert_close(grad_b, hand_b)
    assert not torch.allclose(grad_w, torch.autograd.grad(dense(x), dense.weight, grad_out)[0])


def test_the_saved_copy_is_compressed_to_the_kept_entries():
    x = torch.randn(2, 3, 6, 6)
    conv = prune_activations(nn.Conv2d(3, 4, 3), S)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        conv(x)
    values, positions, weight = saved
    k = kept_entries(x.numel(), S)
    assert k == 54 and values.shape == positions.shape == (k,) and positions.dtype == torch.int32
    assert weight is conv.weight
    assert torch.count_nonzero(values) == k
    torch.testing.assert_close(values.abs().sort().values, x.abs().flatten().sort().values[-k:])


def test_switching_keeps_state_keys_and_parameters():
    model = conv_net()
    weight, keys = model[0].weight, list(model.state_dict())
    prune_activations(model, S)
    assert type(model[0]) is ActivationPrunedConv2d and type(model[3]) is ActivationPrunedLinear
    assert model[0].weight is weight and list(model.state_dict()) == keys


def deep_conv_net():
    torch.manual_seed(0)
    convs = [nn.Conv2d(8, 8, 3, padding=1) for _ in range(3)]
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *convs, nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def test_accountant_sees_the_smaller_saved_activations():
    # No ReLU: the conv and linear inputs are kept by nothing else, so their storage is SAP's to save.
    # Compressing costs transients (|x| while choosing, the dense copy in backward) of about one
    # layer's input, so the peak drops only once several layers' inputs would be alive at once.
    def step(model, x, y):
        return F.cross_entropy(model(x), y)

    dense = measure_training_cost(deep_conv_net(), (3, 8, 8), 10, 16, step=step)
    sparse = measure_training_cost(prune_activations(deep_conv_net(), 0.9), (3, 8, 8), 10, 16, step=step)
    assert sparse.activation_bytes < dense.activation_bytes / 2
    assert sparse.peak_bytes < dense.peak_bytes


def test_meter_counts_values_and_positions():
    x = torch.randn(4, 8, 8, 8)
    conv = prune_activations(nn.Conv2d(8, 8, 3), 0.9)
    meter = SavedTensorMeter(exclude=[conv.weight, conv.bias, x])
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        conv(x)
    assert meter.bytes == kept_entries(x.numel(), 0.9) * (4 + 4)  # float32 values, int32 positions


def test_mask_relu_saves_a_boolean_mask_and_gives_relus_gradients():
    from hfl.pruning.sap import MaskReLU

    x = torch.randn(4, 8, 5, 5, requires_grad=True)
    relu = prune_activations(nn.Sequential(nn.ReLU()), 0.9, relu_masks=True)[0]
    assert type(relu) is MaskReLU
    meter = SavedTensorMeter(exclude=[x])
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        out = relu(x)
    assert meter.bytes == x.numel()  # one byte per entry, not the float output's four
    grad = torch.randn_like(x)
    (dense_grad,) = torch.autograd.grad(F.relu(x), x, grad)
    assert torch.equal(out, F.relu(x)) and torch.equal(torch.autograd.grad(out, x, grad)[0], dense_grad)
    assert type(prune_activations(nn.Sequential(nn.ReLU()), 0.9)[0]) is nn.ReLU  # off by default


def test_masked_relus_let_sap_lower_the_peak_of_a_relu_conv_chain():
    """A ReLU before each conv keeps its float output for backward, which is also the conv's input:
    SAP alone cannot free it; with masked ReLUs the activations drop by more than half."""
    def net():
        torch.manual_seed(0)
        layers = [nn.Conv2d(3, 8, 3, padding=1)]
        for _ in range(3):
            layers += [nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)]
        return nn.Sequential(*layers, nn.Flatten(), nn.Linear(8 * 8 * 8, 10))

    def step(model, x, y):
        return F.cross_entropy(model(x), y)

    dense = measure_training_cost(net(), (3, 8, 8), 10, 16, step=step)
    plain = measure_training_cost(prune_activations(net(), 0.9), (3, 8, 8), 10, 16, step=step)
    masked = measure_training_cost(prune_activations(net(), 0.9, relu_masks=True), (3, 8, 8), 10, 16, step=step)
    assert plain.activation_bytes > 0.9 * dense.activation_bytes  # the ReLUs' outputs stay
    assert masked.activation_bytes < dense.activation_bytes / 2 and masked.peak_bytes < plain.peak_bytes


@pytest.mark.slow
def test_sap_with_masked_relus_lowers_preresnet20s_peak_from_49_5_to_37_4_mib():
    """The docs' figure, FedMef's client without NSConv (batch norms) at batch 32 on 32x32: SAP
    alone raises the peak (the ReLUs keep their outputs, the compressed copies add to them), masked
    ReLUs let it fall."""
    def peak_mib(model):
        return round(measure_training_cost(model, (3, 32, 32), 10, 32, count_flops=False).peak_bytes / 2**20, 1)

    def net():
        torch.manual_seed(0)
        return build_model("preresnet20", 3, 10, 1.0, "bn")

    assert peak_mib(net()) == 49.5
    assert peak_mib(prune_activations(net(), 0.9)) == 54.6
    assert peak_mib(prune_activations(net(), 0.9, relu_masks=True)) == 37.4
