"""Sub-model spec algebra: identity, round trips, and width-r extraction equal to a width-r model."""

import pytest
import torch

from hfl.models import build_model
from hfl.submodel import (
    SubmodelSpec,
    drop_blocks,
    extract,
    full_spec,
    scatter,
    width_spec,
)

MODELS = ["cnn", "preresnet20", "resnet18", "mobilenetv2"]


def randomised(model):
    """Random BN statistics and affine parameters on top of the random init, so any mis-sliced
    entry changes the output."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                for t in (module.weight, module.running_var):
                    t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
                for t in (module.bias, module.running_mean):
                    t.copy_(0.1 * torch.randn(t.shape, generator=gen))
    return model.eval()


@pytest.mark.parametrize("name", MODELS)
def test_full_spec_is_identity(name):
    state = build_model(name, 1, 10).state_dict()
    out = extract(state, full_spec())
    assert out.keys() == state.keys() and all(torch.equal(out[k], state[k]) for k in state)
    values, coverage = scatter(out, full_spec(), state)
    assert all(torch.equal(values[k], state[k]) and coverage[k].all() for k in state)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("offset", [0, 3])
def test_extract_then_scatter_round_trips(name, offset):
    model = build_model(name, 1, 10)
    state = model.state_dict()
    offsets = {g.name: offset for g in model.channel_groups()}
    spec = width_spec(model, 0.5, offsets)
    sub = extract(state, spec)
    values, coverage = scatter(sub, spec, state)
    for key, tensor in state.items():
        assert torch.equal(values[key][coverage[key]], tensor[coverage[key]])
        assert int(coverage[key].sum()) == sub[key].numel()
    # Extracting again from the scattered values gives the client state back.
    again = extract(values, spec)
    assert all(torch.equal(again[k], sub[k]) for k in sub)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("width", [0.5, 0.25])
@pytest.mark.parametrize("rolled", [False, True])
def test_width_submodel_equals_fresh_width_model(name, width, rolled):
    """A width-r model loaded with extracted weights computes what the global model computes when
    every entry outside the sub-model is zero."""
    big = randomised(build_model(name, 3, 10, width=1.0))
    offsets = {g.name: 5 for g in big.channel_groups()} if rolled else None
    spec = width_spec(big, width, offsets)
    small = build_model(name, 3, 10, width=width).eval()
    small.load_state_dict(extract(big.state_dict(), spec), strict=True)
    values, _ = scatter(extract(big.state_dict(), spec), spec, big.state_dict())
    big.load_state_dict(values)  # zero weight and bias outside the sub-model: those channels stay 0
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(small(x), big(x), rtol=1e-4, atol=1e-4)


def test_width_spec_rejects_wider_than_model():
    model = build_model("cnn", 1, 10, width=0.5)
    with pytest.raises(ValueError, match="channels of group"):
        width_spec(model, 1.0)


def test_depth_spec_drops_exactly_the_block_tensors():
    model = build_model("preresnet20", 3, 10)
    droppable = [b.index for b in model.blocks() if b.droppable][:2]
    spec = drop_blocks(full_spec(), model, droppable)
    sub = extract(model.state_dict(), spec)
    client = build_model("preresnet20", 3, 10)
    client.drop_blocks(spec.dropped_blocks)
    client.load_state_dict(sub, strict=True)
    assert {k for k in model.state_dict() if k not in sub} == spec.absent
    assert all(k.startswith(tuple(f"body.{i}." for i in droppable)) for k in spec.absent)


def test_places_map_client_models_to_models_of_the_global_state():
    """A client model assembled from several global models (SplitMix's bases): extract reads each
    from its global prefix, scatter writes it back there, the other models stay uncovered."""
    single = build_model("cnn", 1, 10, 0.25).state_dict()
    state = {f"m.{i}.{k}": v + i for i in range(3) for k, v in single.items()}
    spec = SubmodelSpec(places=(("c.0.", "m.2."), ("c.1.", "m.0.")))
    sub = extract(state, spec)
    assert set(sub) == {f"c.{j}.{k}" for j in range(2) for k in single}
    assert torch.equal(sub["c.0.head.fc.weight"], state["m.2.head.fc.weight"])
    assert spec.global_key("c.1.head.fc.bias") == "m.0.head.fc.bias"
    values, coverage = scatter(sub, spec, state)
    for key, tensor in state.items():
        held = not key.startswith("m.1.")
        assert bool(coverage[key].all()) == held and (not held or torch.equal(values[key], tensor))
    with pytest.raises(ValueError, match="places"):
        SubmodelSpec(prefix="x.", places=(("c.0.", "m.0."),))


def test_masks_on_the_cpu_meet_weights_on_another_device():
    """A sparse method's masks stay on the CPU with its state while the weights and updates may be on
    a GPU (the meta device stands in for it here: it refuses CPU operands just as CUDA does)."""
    from hfl.submodel.spec import hold_rows

    weight = torch.ones(3, 4)
    masks = {"w": torch.tensor([[True, False, True, False]] * 3)}
    spec = SubmodelSpec(masks=masks)
    on_device = {"w": weight.to("meta")}
    assert extract(on_device, spec)["w"].device.type == "meta"
    values, coverage = scatter(on_device, spec, on_device)
    assert values["w"].device.type == coverage["w"].device.type == "meta"
    held = hold_rows(spec, on_device, ["w"], torch.tensor([0]))
    assert held.masks["w"].device.type == "meta"
    # The values themselves, on the CPU: masked entries zeroed and not covered.
    values, coverage = scatter(extract({"w": weight}, spec), spec, {"w": weight})
    assert torch.equal(values["w"], masks["w"].float()) and torch.equal(coverage["w"], masks["w"])
