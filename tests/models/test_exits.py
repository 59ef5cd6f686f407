"""Early exits and depth prefixes: structure, state keys and agreement with the global model."""

import pytest
import torch

from hfl.models import build_model
from hfl.models.exits import add_exits
from hfl.submodel import extract, full_spec, shape_model, truncate, width_spec

SHAPES = {"cnn": (1, 8, 8), "preresnet20": (3, 16, 16), "resnet18": (3, 16, 16), "mobilenetv2": (3, 16, 16)}


def with_exits(name, width=1.0, kind="linear"):
    channels = SHAPES[name][0]
    model = build_model(name, channels, 10, width, "bn")
    add_exits(model, range(len(model.body) - 1), kind)
    return model.eval()


@pytest.mark.parametrize("kind", ["linear", "bottleneck"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_a_truncated_slice_computes_what_the_global_model_computes_at_that_exit(name, kind):
    torch.manual_seed(0)
    model = with_exits(name, kind=kind)
    x = torch.randn(2, *SHAPES[name])
    outputs = model.forward_exits(x)
    assert len(outputs) == len(model.body)  # an exit after every block but the last, then the head
    depth = max(1, len(model.body) // 2)
    spec = truncate(full_spec(), model, depth)
    sub = shape_model(with_exits(name, kind=kind), spec)
    sub.load_state_dict(extract(model.state_dict(), spec), strict=True)
    assert sub.head is None and sub.exit_blocks == tuple(range(depth))
    assert torch.allclose(sub(x), outputs[depth - 1], atol=1e-6)


def test_truncation_marks_deeper_blocks_exits_and_head_absent():
    model = with_exits("preresnet20")
    spec = truncate(width_spec(model, 0.5), model, 3)
    assert spec.depth == 3
    assert any(k.startswith("body.3.") for k in spec.absent) and not any(k.startswith("body.2.") for k in spec.absent)
    assert "exits.3.classifier.fc.weight" in spec.absent and "exits.2.classifier.fc.weight" not in spec.absent
    assert "head.fc.weight" in spec.absent
    # exit classifiers are width-sliced with the features they read
    assert len(spec.indices["exits.2.classifier.fc.weight"][1]) == 8


def test_bottleneck_exits_reach_the_last_stage_channels():
    model = with_exits("preresnet20", kind="bottleneck")
    assert model.exits["2"].classifier.fc.in_features == 64 and model.exits["5"].classifier.fc.in_features == 64


def test_exits_refuse_the_last_block_and_out_of_range_blocks():
    model = build_model("cnn", 1, 10, 1.0, "bn")
    with pytest.raises(ValueError, match="exit must follow"):
        add_exits(model, [1])
    with pytest.raises(ValueError, match="depth must be"):
        model.truncate(0)
