"""Block-by-block inference: the same logits as the whole-model forward, its files, its peak memory."""

import pytest
import torch

from hfl.config import FLConfig, config_from_dict
from hfl.errors import ConfigError
from hfl.inference import (
    PeakMemoryMeter,
    blockwise_inference,
    module_bytes,
    stages,
    standard_inference,
)
from hfl.models import build_model
from hfl.models.exits import add_exits
from hfl.server import run_experiment
from tests.conftest import small_config


def model_and_inputs(name, exits, width=1.0, samples=10):
    torch.manual_seed(0)
    model = build_model(name, in_channels=1, num_classes=10, width=width)
    if exits:
        add_exits(model, [2, 5], "linear")
    return model.eval(), torch.randn(samples, 1, 8, 8)


@pytest.mark.parametrize("spill", [False, True])
@pytest.mark.parametrize(("name", "exits"), [("preresnet20", False), ("preresnet20", True), ("cnn", False)])
def test_blockwise_logits_equal_forward_exits(tmp_path, name, exits, spill):
    model, x = model_and_inputs(name, exits)
    with torch.no_grad():
        expected = [torch.cat(parts) for parts in zip(*(model.forward_exits(x[i : i + 4]) for i in range(0, len(x), 4)))]
    result = blockwise_inference(model, x, batch_size=4, spill_dir=tmp_path / "spill" if spill else None)
    assert len(result.outputs) == len(expected) == (3 if exits else 1)
    for got, want in zip(result.outputs, expected):
        assert torch.allclose(got, want, atol=1e-6)
    assert result.peak_bytes > 0
    if spill:
        assert list((tmp_path / "spill").iterdir()) == []


def test_a_truncated_model_with_dropped_blocks_gives_its_exits():
    model, x = model_and_inputs("preresnet20", exits=True)
    model.drop_blocks({1})
    model.truncate(6)
    assert [s.name for s in stages(model)][:4] == ["stem", "body.0", "body.2", "exits.2"]  # identities skipped
    result = blockwise_inference(model, x, batch_size=3)
    with torch.no_grad():
        expected = model.forward_exits(x)
    assert len(result.outputs) == 2 and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(result.outputs, expected))


def test_spill_keeps_one_file_per_stage_on_disk_and_removes_them(tmp_path):
    model, x = model_and_inputs("preresnet20", exits=False)
    seen = []
    model.body[3].register_forward_hook(lambda *_: seen.append(sorted(p.name for p in tmp_path.iterdir())))
    blockwise_inference(model, x, batch_size=4, spill_dir=tmp_path)
    # While block 3 runs (3 batches), it reads block 2's file and fills its own, made at its first
    # output; block 1's file is gone.
    assert [{name.split("-")[1] for name in names} for names in seen] == [{"body.2"}, *[{"body.2", "body.3"}] * 2]
    assert list(tmp_path.iterdir()) == []


def test_an_error_mid_stage_leaves_no_file(tmp_path):
    model, x = model_and_inputs("cnn", exits=False)

    def fail(*_):
        raise RuntimeError("boom")

    model.body[1].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        blockwise_inference(model, x, batch_size=4, spill_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cpu_meter_counts_each_storage_once_while_it_lives():
    with PeakMemoryMeter("cpu") as meter:
        a = torch.empty(2**20, dtype=torch.uint8)
        view = a[10:]
        view.add_(1)  # a view and an in-place op allocate nothing
        del a, view
        b = torch.empty(2**20, dtype=torch.uint8)  # the first megabyte is free again
        meter.charge(1000)
        meter.charge(-1000)
    assert meter.peak_bytes == 2**20 + 1000
    del b


def test_spilling_keeps_the_whole_set_of_activations_out_of_memory(tmp_path):
    model, x = model_and_inputs("cnn", exits=False, samples=256)
    in_memory = blockwise_inference(model, x, batch_size=8)
    spilled = blockwise_inference(model, x, batch_size=8, spill_dir=tmp_path)
    # In memory, block 1's input for all 256 inputs (32 x 4 x 4 floats each) and its output are held;
    # spilled, a batch's copy of them.
    assert in_memory.peak_bytes - spilled.peak_bytes > 256 * 32 * 4 * 4 * 4


def test_blockwise_peak_is_below_the_whole_models_when_weights_dominate(tmp_path):
    # A wide network on a few 8x8 inputs: its 4.3M weights (17 MB) dwarf a batch's activations
    # (2 x 256 x 2 x 2 floats at the last stage). The standard forward holds all the weights; the
    # block-wise one only the running block's (the largest, 256->256 convs, is about a quarter).
    model, x = model_and_inputs("preresnet20", exits=False, width=4.0, samples=4)
    standard = standard_inference(model, x, batch_size=2)
    blockwise = blockwise_inference(model, x, batch_size=2, spill_dir=tmp_path)
    largest_stage = max(module_bytes(s.module) for s in stages(model))
    assert standard.peak_bytes >= module_bytes(model)
    assert largest_stage <= blockwise.peak_bytes < module_bytes(model) / 3
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(standard.outputs, blockwise.outputs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_only_one_stage_is_on_the_device_and_the_model_comes_back():
    model, x = model_and_inputs("preresnet20", exits=True, width=4.0, samples=4)
    model, x = model.cuda(), x.cuda()
    standard = standard_inference(model, x, batch_size=2)
    blockwise = blockwise_inference(model, x, batch_size=2)
    assert all(p.is_cuda for p in model.parameters())
    assert blockwise.peak_bytes < module_bytes(model) / 2 <= standard.peak_bytes
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(standard.outputs, blockwise.outputs))


def test_a_bad_eval_mode_or_spill_dir_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="eval_mode"):
        FLConfig(eval_mode="bogus")
    with pytest.raises(ConfigError) as info:
        config_from_dict({"fl": {"eval_mode": "bogus"}})
    assert info.value.field == "fl.eval_mode"
    with pytest.raises(ConfigError, match="eval_spill_dir"):
        FLConfig(eval_spill_dir="spill")


def test_blockwise_evaluation_gives_the_standard_runs_scores(tmp_path):
    standard = run_experiment(small_config(fl={"rounds": 2}), tmp_path / "standard")
    spill = tmp_path / "spill"
    blockwise = run_experiment(small_config(fl={"rounds": 2, "eval_mode": "blockwise", "eval_spill_dir": str(spill)}), tmp_path / "blockwise")
    assert blockwise["final_accuracy"] == standard["final_accuracy"]
    assert blockwise["final_loss"] == standard["final_loss"]
    assert 0 < blockwise["final_inference_peak_bytes"] and 0 < standard["final_inference_peak_bytes"]
    assert spill.is_dir() and list(spill.iterdir()) == []  # made, used and emptied by the blockwise runs
