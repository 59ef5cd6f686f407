"""Accounting against numbers computed by hand on models small enough to count."""

import pytest
import torch
from torch import nn

from hfl.accounting.cost import measure_training_cost

B = 32
F32 = 4


def sum_step(model, x, y):
    """A loss whose backward saves nothing itself, so only the model's saved tensors count."""
    return model(x).sum()


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def cnn(*frozen):
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 2, 3, padding=1)
    )
    for i in frozen:
        model[i].requires_grad_(False)
    return model


def test_mlp_memory_by_hand():
    cost = measure_training_cost(mlp(), (8,), 4, B, optimizer="sgd_momentum", step=sum_step)
    params = (8 * 16 + 16 + 16 * 4 + 4) * F32
    assert cost.param_bytes == cost.grad_bytes == cost.optimizer_bytes == params
    # ReLU keeps its output; the second linear keeps its input, the same storage: counted once.
    # The first linear keeps the input batch, which is counted as input, not as an activation.
    assert cost.activation_bytes == B * 16 * F32
    assert cost.input_bytes == B * 8 * F32 + B * 8  # inputs, int64 labels
    # The peak comes during the ReLU's backward: weights, momentum, batch, and alive at that moment
    # the ReLU output kept for backward, the gradient reaching it and the gradient leaving it
    # (B x 16 each), the second layer's weight and bias gradients, the loss and its gradient seed.
    # The first layer's gradients come later, when those activations are already freed.
    held = params + params + cost.input_bytes
    assert cost.peak_bytes == held + 3 * B * 16 * F32 + (16 * 4 + 4) * F32 + 2 * F32


def test_optimizer_state_by_kind():
    for kind, copies in (("sgd", 0), ("sgd_momentum", 1), ("adam", 2)):
        cost = measure_training_cost(mlp(), (8,), 4, B, optimizer=kind, step=sum_step)
        assert cost.optimizer_bytes == copies * cost.grad_bytes


def test_mlp_flops_by_hand():
    cost = measure_training_cost(mlp(), (8,), 4, B, step=sum_step)
    assert cost.forward_flops_per_sample == 2 * (8 * 16 + 16 * 4)
    # Backward: both weight gradients, and the input gradient of the second layer only (the input
    # batch needs none).
    assert cost.backward_flops_per_sample == 2 * (8 * 16 + 16 * 4) + 2 * 16 * 4


def test_two_conv_cnn_activations_and_flops_by_hand():
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1))
    cost = measure_training_cost(model, (1, 8, 8), 6, B, step=sum_step)
    assert cost.activation_bytes == B * 4 * 8 * 8 * F32  # the ReLU output, shared with conv2's input
    conv1, conv2 = 2 * 4 * 64 * 1 * 9, 2 * 6 * 64 * 4 * 9  # 2 * C_out * H * W * C_in * k * k
    assert cost.forward_flops_per_sample == conv1 + conv2
    assert cost.backward_flops_per_sample == conv1 + 2 * conv2


def test_frozen_prefix_saves_no_activations():
    full = measure_training_cost(cnn(), (1, 8, 8), 2, B, step=sum_step)
    frozen = measure_training_cost(cnn(0, 2), (1, 8, 8), 2, B, step=sum_step)
    assert full.activation_bytes == B * (4 + 6) * 64 * F32
    assert frozen.activation_bytes == B * 6 * 64 * F32  # only the trained conv's input
    assert frozen.grad_bytes == (6 * 2 * 9 + 2) * F32


def test_measurement_leaves_the_model_untouched():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3))
    model(torch.zeros(2, 1, 8, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measure_training_cost(model, (1, 8, 8), 3, 16)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_measuring_in_place_costs_what_measuring_a_copy_does():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)).eval()

    copied = measure_training_cost(model(), (1, 8, 8), 3, 16)
    assert measure_training_cost(model(), (1, 8, 8), 3, 16, in_place=True) == copied  # trained in train mode like the copy


def test_real_model_cost_grows_with_batch_and_width():
    from hfl.models import build_model

    small = measure_training_cost(build_model("preresnet20", 3, 10, width=0.5), (3, 16, 16), 10, 8)
    wide = measure_training_cost(build_model("preresnet20", 3, 10, width=1.0), (3, 16, 16), 10, 8)
    big_batch = measure_training_cost(build_model("preresnet20", 3, 10, width=0.5), (3, 16, 16), 10, 16)
    assert wide.activation_bytes == pytest.approx(2 * small.activation_bytes, rel=0.02)
    assert big_batch.activation_bytes == pytest.approx(2 * small.activation_bytes, rel=0.02)
    assert wide.train_flops_per_sample > 3 * small.train_flops_per_sample


@pytest.mark.parametrize(("model_name", "optimizer", "weight_decay"), [("preresnet20", "sgd_momentum", 5e-4), ("vit", "adam", 0.0), ("cnn", "sgd", 0.0)])
def test_peak_extrapolated_from_two_small_batches_equals_a_direct_run(model_name, optimizer, weight_decay):
    """The timeline at batches 2 and 4 gives the peak at any batch exactly: the same steps run at
    batch 24 under the tracker peak at the same number of bytes."""
    import copy

    from hfl.accounting.cost import cross_entropy_step, probe_optimizer
    from hfl.accounting.memory import LiveStorageTracker
    from hfl.models import build_model

    model = build_model(model_name, 3, 10, width=0.25)
    batch = 24
    cost = measure_training_cost(model, (3, 16, 16), 10, batch, optimizer=optimizer, weight_decay=weight_decay)
    probe = copy.deepcopy(model).train()
    x, y = torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,))
    opt = probe_optimizer(list(probe.parameters()), optimizer, weight_decay)
    with LiveStorageTracker() as tracker:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            cross_entropy_step(probe, x, y).backward()
            opt.step()
    held = cost.param_bytes + x.nbytes + y.nbytes
    assert cost.peak_bytes == held + tracker.peak_bytes


def test_peak_is_not_the_sum_of_the_parts():
    """Gradients and activations are never all alive at once (ResNet-18: the last layers' large
    weight gradients come when most activations are freed), and transients add to what is."""
    from hfl.models import build_model

    cost = measure_training_cost(build_model("resnet18", 3, 10, width=0.5), (3, 32, 32), 10, 16)
    parts = cost.param_bytes + cost.grad_bytes + cost.optimizer_bytes + cost.activation_bytes + cost.input_bytes
    assert cost.param_bytes + cost.optimizer_bytes + cost.activation_bytes < cost.peak_bytes < parts


def test_conv_workspace_adds_the_largest_unfolded_input_once():
    """CUDA's convolutions without cuDNN unfold one image's input outside torch's tensors; on an H100
    FeDepth's single blocks measured 0.56 MiB above the estimate, PreResNet-20's first-stage
    convolution's 16 x 3 x 3 x 32 x 32 floats. 1x1 convolutions that neither stride nor pad, and
    depthwise ones, unfold nothing."""
    from hfl.accounting.cost import conv_workspace_bytes
    from hfl.models import build_model

    model = build_model("preresnet20", 3, 10, width=1.0)
    plain = measure_training_cost(model, (3, 32, 32), 10, 8)
    with_workspace = measure_training_cost(model, (3, 32, 32), 10, 8, conv_workspace=True)
    assert with_workspace.peak_bytes - plain.peak_bytes == 16 * 3 * 3 * 32 * 32 * 4
    out = torch.zeros(1, 8, 5, 5)
    assert conv_workspace_bytes(nn.Conv2d(4, 8, 1), out) == 0
    assert conv_workspace_bytes(nn.Conv2d(4, 8, 1, stride=2), out) == 4 * 25 * 4
    assert conv_workspace_bytes(nn.Conv2d(8, 8, 3, groups=8), out) == 0
    assert conv_workspace_bytes(nn.Conv2d(4, 8, 3, groups=2), out) == 2 * 9 * 25 * 4


def test_budgeted_clients_on_cuda_count_their_headroom_and_without_cudnn_the_unfolded_input():
    """Without cuDNN the unfolded input of the largest convolution; with budgets on CUDA the
    headroom every client keeps under the allocator's cap of its budget (pages, cuDNN's workspace)."""
    from hfl.experiment import ClientEnvironment, clients_train_on_cuda
    from hfl.models import build_model
    from tests.conftest import small_config

    budgeted = {"scenario": "fair"}
    assert clients_train_on_cuda(small_config(backend={"device": "cuda"}))
    assert not clients_train_on_cuda(small_config(backend={"device": "cpu", "name": "ray", "num_gpus_per_client": 0.5}))
    auto = {"device": "auto"}
    assert clients_train_on_cuda(small_config(backend={**auto, "name": "ray", "num_gpus_per_client": 0.5}))
    assert clients_train_on_cuda(small_config(backend={**auto, "name": "ray", "gpu_memory": "80GB"}))
    assert clients_train_on_cuda(small_config(backend=auto)) == torch.cuda.is_available()
    # A CPU head planning for GPU actors counts what they will hold.
    ray_gpus = {**auto, "name": "ray", "num_gpus_per_client": 0.5}
    off = ClientEnvironment.from_config(small_config(backend={**ray_gpus, "cudnn": "off"}, budgets=budgeted)).accountant
    on = ClientEnvironment.from_config(small_config(backend={**ray_gpus, "cuda_headroom_mib": 3}, budgets=budgeted)).accountant
    unbudgeted = ClientEnvironment.from_config(small_config(backend=ray_gpus)).accountant
    cpu = ClientEnvironment.from_config(small_config(backend={"device": "cpu"}, budgets=budgeted)).accountant
    assert (off.conv_workspace, off.cuda_headroom) == (True, 4 * 2**20)
    assert (on.conv_workspace, on.cuda_headroom) == (False, 3 * 2**20)
    assert (unbudgeted.conv_workspace, unbudgeted.cuda_headroom) == (False, 0)
    assert (cpu.conv_workspace, cpu.cuda_headroom) == (False, 0)
    model = build_model("preresnet20", 3, 10, width=0.25)
    with_headroom = measure_training_cost(model, (3, 32, 32), 10, 8, headroom=3 * 2**20).peak_bytes
    assert with_headroom - measure_training_cost(model, (3, 32, 32), 10, 8).peak_bytes == 3 * 2**20


def test_held_tensors_count_until_they_are_freed():
    """What an untracked first step leaves (gradients, optimiser state) counts from the tracked
    step's start, once per storage, and stops counting when it is freed."""
    from hfl.accounting.memory import LiveStorageTracker

    grad, state = torch.ones(100), torch.ones(50)
    with LiveStorageTracker("cpu") as tracker:
        tracker.hold([grad, state, grad[:10]])
        assert tracker.live_bytes == 600
        del grad
        assert tracker.live_bytes == 200
        doubled = state * 2
        assert tracker.live_bytes == 400
    assert tracker.peak_bytes == 600 and doubled.shape == state.shape
