"""torchvision ResNet weights from a local file: what is loaded, what is skipped, what is refused."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torchvision

from hfl.backends.base import build_model_for
from hfl.config import ModelConfig
from hfl.errors import ConfigError
from hfl.models import build_model, load_torchvision_resnet
from hfl.models.pretrained import TORCHVISION_FILES


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory):
    """A folder laid out like torch's hub cache, holding a (randomly initialised) torchvision ResNet-18."""
    torch.manual_seed(1)
    reference = torchvision.models.resnet18(weights=None)
    with torch.no_grad():  # non-trivial statistics, so loading them is visible
        for module in reference.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
    folder = tmp_path_factory.mktemp("torch") / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(reference.state_dict(), folder / TORCHVISION_FILES["resnet18"])
    return folder.parent.parent, reference.eval()


def test_loads_every_block_and_reports_the_cifar_stem_and_classifier(weights_dir, caplog) -> None:
    folder, reference = weights_dir
    model = build_model("resnet18", 3, 10)

    with caplog.at_level(logging.INFO, logger="hfl.models.pretrained"):
        report = load_torchvision_resnet(model, "resnet18", str(folder))

    theirs = reference.state_dict()
    ours = model.state_dict()
    assert torch.equal(ours["body.0.conv1.weight"], theirs["layer1.0.conv1.weight"])
    assert torch.equal(ours["body.7.bn2.running_var"], theirs["layer4.1.bn2.running_var"])
    assert torch.equal(ours["body.2.shortcut.0.weight"], theirs["layer2.0.downsample.0.weight"])
    assert torch.equal(ours["body.6.shortcut.1.bias"], theirs["layer4.0.downsample.1.bias"])
    assert torch.equal(ours["stem.1.weight"], theirs["bn1.weight"])
    assert {key for key, _ in report.skipped} == {"stem.0.weight", "head.fc.weight", "head.fc.bias"}
    assert set(report.loaded) | {key for key, _ in report.skipped} == set(ours)
    assert "stem.0.weight" in caplog.text and "head.fc.weight" in caplog.text


def test_a_loaded_block_computes_what_torchvisions_block_computes(weights_dir) -> None:
    folder, reference = weights_dir
    model = build_model("resnet18", 3, 1000, pretrained=str(folder / "hub" / "checkpoints" / "resnet18-f37072fd.pth")).eval()
    x = torch.randn(2, 64, 8, 8)

    assert torch.allclose(model.body[2](x), reference.layer2[0](x), atol=1e-5)
    assert torch.equal(model.head.fc.weight, reference.fc.weight)  # 1000 classes: the classifier fits too


def test_static_batch_norm_leaves_the_running_statistics_unused(weights_dir) -> None:
    folder, _ = weights_dir
    model = build_model("resnet18", 1, 10, norm="static_bn")

    report = load_torchvision_resnet(model, "resnet18", str(folder))

    assert "layer1.0.bn1.running_mean" in report.unused and "bn1.num_batches_tracked" in report.unused
    assert "body.0.bn1.weight" in report.loaded


def test_a_missing_file_names_the_field_the_path_and_the_file(tmp_path) -> None:
    model = build_model("resnet18", 3, 10, width=1.0)

    with pytest.raises(ConfigError) as error:
        load_torchvision_resnet(model, "resnet18", str(tmp_path / "weights"))

    message = str(error.value)
    assert message.startswith("model.pretrained=")
    assert str(tmp_path / "weights") in message and "resnet18-f37072fd.pth" in message


def test_a_file_of_another_architecture_is_refused(weights_dir, tmp_path) -> None:
    _, reference = weights_dir
    state = reference.state_dict()
    state["layer1.2.conv1.weight"] = state["layer1.1.conv1.weight"]  # a third block, as ResNet-34 has
    torch.save(state, tmp_path / "other.pth")

    with pytest.raises(ConfigError, match="layers resnet18 lacks"):
        load_torchvision_resnet(build_model("resnet18", 3, 10), "resnet18", str(tmp_path / "other.pth"))


def test_only_full_width_resnet18_and_resnet34_take_pretrained_weights() -> None:
    with pytest.raises(ConfigError, match="pretrained"):
        ModelConfig(name="preresnet20", pretrained="/weights")
    with pytest.raises(ConfigError, match="width"):
        ModelConfig(name="resnet34", width=0.5, pretrained="/weights")
    with pytest.raises(ConfigError, match="model.pretrained"):
        build_model("cnn", 1, 10, pretrained="/weights")


def test_the_experiment_model_loads_them_at_full_width_only(weights_dir) -> None:
    folder, reference = weights_dir
    config = SimpleNamespace(model=ModelConfig(name="resnet18", norm="bn", pretrained=str(folder)))
    data = SimpleNamespace(in_channels=3, num_classes=10, input_kind="images")

    full, half = build_model_for(config, data), build_model_for(config, data, width=0.25)

    assert torch.equal(full.body[3].conv1.weight, reference.layer2[1].conv1.weight)
    assert half.body[3].conv1.weight.shape[0] == 32  # built, not loaded


def test_nefl_starts_every_submodels_batch_norms_from_the_pretrained_ones(weights_dir) -> None:
    from hfl.accounting.accountant import Accountant
    from hfl.methods.base import Resources
    from hfl.methods.nefl import NeFL, NeFLConfig

    folder, reference = weights_dir

    def build(width, norm=None):
        return build_model("resnet18", 3, 10, width, norm or "bn", pretrained=str(folder) if width == 1 else "")

    accountant = Accountant(build=build, input_shape=(3, 32, 32), num_classes=10)
    method = NeFL(NeFLConfig(), Resources(model=build(1.0), build=build, accountant=accountant))
    state = method.initial_global_state()
    pretrained_bn = reference.state_dict()["layer1.0.bn1.running_var"]

    for k in range(1, 6):  # the global state's copy of layer1.0.bn1 for every sub-model
        assert torch.equal(state[f"body.0.bn1.m{k}.running_var"], pretrained_bn)
