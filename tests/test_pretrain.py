"""`hfl pretrain`: a tiny family trains in seconds, resumes bit for bit after SIGKILL, and loads
back through `model.pretrained=<family>:<l>`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from hfl.experiment import ClientEnvironment, build_model_for
from hfl.cli import main
from hfl.config import ModelConfig, build_dataclass, config_from_dict
from hfl.errors import ConfigError
from hfl.models.family import checkpoint_path, weights_path
from hfl.models.gpt import GPT
from hfl.pretrain import PretrainConfig, TextBatches, _mean_loss, pretrain
from hfl.registry import MODELS
from tests.conftest import ROOT, cli_env
from tests.pretrain_fixtures import tiny_family, write_text_corpus


def tiny_config(root, cache, **changes) -> PretrainConfig:
    return build_dataclass(PretrainConfig, tiny_family(root, cache, **changes), "")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """The tiny family, pretrained once: (config, cards)."""
    base = tmp_path_factory.mktemp("pretrain")
    config = tiny_config(write_text_corpus(base / "data"), base / "cache")
    return config, pretrain(config)


class Recorder:
    """A callback that keeps where each member started and, optionally, dies at one step."""

    def __init__(self) -> None:
        self.starts: dict[int, int] = {}

    def on_member_start(self, depth, steps, done, config) -> None:
        self.starts[depth] = done

    def on_step(self, info) -> None:
        pass

    def on_member_end(self, card) -> None:
        pass


def test_the_learning_rate_warms_up_linearly_then_decays_by_a_cosine_to_min_lr(tmp_path) -> None:
    config = tiny_config(tmp_path, tmp_path, lr=1e-3, min_lr=1e-4, warmup_steps=4, budget=13 * 4 * 32)

    assert config.steps == 13
    assert config.lr_at(0) == pytest.approx(0.25e-3)
    assert config.lr_at(3) == pytest.approx(1e-3)
    assert config.lr_at(4) == pytest.approx(1e-3)  # the cosine starts at the peak
    assert config.lr_at(6) == pytest.approx(1e-4 + 0.45e-3 * (1 + math.cos(math.pi / 4)))
    assert config.lr_at(8) == pytest.approx(5.5e-4)  # half way: the mean of lr and min_lr
    assert config.lr_at(12) == pytest.approx(1e-4)  # the last step


def test_the_optimiser_steps_with_the_schedule(tmp_path, monkeypatch) -> None:
    config = tiny_config(write_text_corpus(tmp_path / "data"), tmp_path / "cache", depths=[1])
    seen: list[float] = []
    step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    pretrain(config)

    assert seen == [config.lr_at(s) for s in range(config.steps)]


def test_the_card_records_shape_corpus_tokens_losses_and_provenance(family) -> None:
    config, cards = family
    card = json.loads((weights_path(config.cache_dir, "tiny", 2).with_suffix(".json")).read_text())

    assert [c["depth"] for c in cards] == [1, 2] and card == cards[1]
    assert card["shape"] == {"model": "gpt", "depth": 2, "dim": 16, "heads": 2, "context": 32, "vocab_size": 81}
    assert card["corpus"]["name"] == "sst2_agnews" and len(card["corpus"]["sources"]) == 2
    assert all(len(s["sha256"]) == 64 for s in card["corpus"]["sources"])
    assert card["tokenizer"] == "chars"
    assert card["tokens_seen"] == 12 * 4 * 32 and card["steps"] == 12
    assert math.isfinite(card["final_train_loss"]) and math.isfinite(card["final_val_loss"])
    assert card["final_val_loss"] < math.log(81)  # learnt something beyond a uniform guess
    assert card["seed"] == 0 and card["wall_seconds"] > 0 and card["hfl_version"]
    assert card["parameters"] == sum(t.numel() for t in load_file(weights_path(config.cache_dir, "tiny", 2)).values())


def test_a_member_loads_back_bit_exact_through_model_pretrained(family, monkeypatch) -> None:
    config, cards = family

    def tiny_gpt(in_channels, num_classes, width=1.0, norm="bn"):
        return GPT(num_classes, width, norm, dim=16, depth=2, heads=2, context=32)

    monkeypatch.setitem(MODELS._entries, "gpt_tiny", tiny_gpt)  # a registered model of the family's shape
    run = SimpleNamespace(model=ModelConfig(name="gpt_tiny", norm="bn", pretrained="tiny:2"),
                          data=SimpleNamespace(cache_dir=config.cache_dir))
    model = build_model_for(run, SimpleNamespace(in_channels=1, num_classes=81, input_kind="tokens", name="text"))

    saved = load_file(weights_path(config.cache_dir, "tiny", 2))
    assert set(saved) == set(model.state_dict())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    # The weights are the trained ones: they give the card's validation loss exactly.
    from hfl.data.corpora import load_text_corpus

    corpus = load_text_corpus("sst2_agnews", config.data_root, "chars", config.eval_fraction)
    assert _mean_loss(model, TextBatches(corpus, config, torch.device("cpu")).validation())[0] == cards[1]["final_val_loss"]

    with warnings.catch_warnings(), torch.device("meta"):  # shapes only (upload sizes): nothing loaded, nothing warned
        warnings.simplefilter("error")
        assert next(build_model_for(run, SimpleNamespace(in_channels=1, num_classes=81, input_kind="tokens", name="text")).parameters()).is_meta


def test_assembling_an_experiment_finds_the_family_in_its_cache_dir(family) -> None:
    """A config is data (it checks no files); assembling the experiment looks the member up, before any data is loaded."""
    config, _ = family
    values = {"data": {"cache_dir": config.cache_dir}, "model": {"name": "gpt", "pretrained": "tiny:1"}}
    missing = config_from_dict({**values, "model": {"name": "gpt", "pretrained": "tiny:3"}})

    assert config_from_dict(values).model.pretrained == "tiny:1"
    assert missing.model.pretrained == "tiny:3"
    with pytest.raises(ConfigError, match="holds l1, l2 but not l3"):
        ClientEnvironment.from_config(missing)


def test_weights_of_another_shape_are_a_config_error_naming_field_value_and_shapes(family) -> None:
    config, _ = family
    run = SimpleNamespace(model=ModelConfig(name="gpt_l3", norm="bn", pretrained="tiny:1"),
                          data=SimpleNamespace(cache_dir=config.cache_dir))

    with pytest.raises(ConfigError) as error:
        build_model_for(run, SimpleNamespace(in_channels=1, num_classes=81, input_kind="tokens", name="text"))

    message = str(error.value)
    assert message.startswith("model.pretrained='tiny:1' is not allowed")
    assert "model.name=gpt_l3" in message and "1 blocks in the file, 3 in the model" in message
    with pytest.raises(ConfigError, match=r"stem.tokens.weight has shape \(81, 16\) in the file, \(256, 16\)"):
        from hfl.models.family import load_family_weights

        load_family_weights(GPT(256, dim=16, depth=1, heads=2, context=32), "tiny:1", config.cache_dir, "gpt")


def test_a_missing_family_exits_2_naming_the_command_that_builds_it(tmp_path, capsys) -> None:
    code = main(["run", str(ROOT / "experiments" / "quickstart.yaml"), "model.name=gpt_l3", "model.pretrained=lm_cpu:3",
                 f"data.cache_dir={tmp_path}"])

    err = capsys.readouterr().err
    assert code == 2
    assert "model.pretrained='lm_cpu:3'" in err
    assert f"`hfl pretrain experiments/pretrain/lm_cpu.yaml cache_dir={tmp_path}`" in err
    assert "on a 2-core CPU" in err


@pytest.mark.slow
def test_resuming_after_sigkill_gives_the_uninterrupted_weights_bit_for_bit(family, tmp_path) -> None:
    config, cards = family
    killed = tiny_config(config.data_root, tmp_path / "cache")
    # Killed at step 8 of the second member: the first is finished, the second has a checkpoint at step 5.
    script = (
        "import json, os, signal, sys\n"
        "from hfl.config import build_dataclass\n"
        "from hfl.pretrain import PretrainConfig, pretrain\n"
        "class Kill:\n"
        "    def on_member_start(self, *a): pass\n"
        "    def on_member_end(self, card): pass\n"
        "    def on_step(self, info):\n"
        "        if info.depth == 2 and info.step == 8: os.kill(os.getpid(), signal.SIGKILL)\n"
        "pretrain(build_dataclass(PretrainConfig, json.loads(sys.argv[1]), ''), Kill())\n"
    )
    values = tiny_family(config.data_root, tmp_path / "cache")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(values)], env=cli_env(), cwd=ROOT, capture_output=True,
                          check=False)
    assert done.returncode == -9, done.stderr.decode()
    assert checkpoint_path(killed.cache_dir, "tiny", 2).is_file()
    assert not weights_path(killed.cache_dir, "tiny", 2).exists()

    recorder = Recorder()
    resumed = pretrain(killed, recorder)

    assert recorder.starts == {2: 5}  # l1 was reused, l2 resumed from its checkpoint
    for depth in (1, 2):
        assert weights_path(killed.cache_dir, "tiny", depth).read_bytes() == weights_path(config.cache_dir, "tiny", depth).read_bytes()
    for key in ("final_train_loss", "final_val_loss", "weights_sha256"):
        assert [c[key] for c in resumed] == [c[key] for c in cards], key
    assert not checkpoint_path(killed.cache_dir, "tiny", 2).exists()


def test_a_checkpoint_of_another_config_is_not_resumed(family, tmp_path) -> None:
    config, _ = family
    first = tiny_config(config.data_root, tmp_path, depths=[1])

    class Stop(Recorder):
        def on_step(self, info) -> None:
            if info.step == 6:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pretrain(first, Stop())
    with pytest.raises(ConfigError, match="lr: 0.003 -> 0.001"):
        pretrain(tiny_config(config.data_root, tmp_path, depths=[1], lr=1e-3))


def test_bad_fields_exit_2_naming_field_value_and_what_is_allowed(tmp_path, capsys) -> None:
    path = ROOT / "experiments" / "pretrain" / "lm_cpu.yaml"

    assert main(["pretrain", str(path), "tokenizer=words"]) == 2
    assert "tokenizer='words' is not allowed: expected one of chars, bytes" in capsys.readouterr().err
    assert main(["pretrain", str(path), "corpus=cifar10_jpeg_0_4"]) == 2
    assert "corpus='cifar10_jpeg_0_4' is not allowed: expected one of sst2_agnews" in capsys.readouterr().err
    assert main(["pretrain", str(path), "heads=5"]) == 2
    assert "heads=5 is not allowed: expected a divisor of dim (96)" in capsys.readouterr().err


def test_a_missing_corpus_exits_2_naming_the_path(tmp_path, capsys) -> None:
    path = ROOT / "experiments" / "pretrain" / "lm_cpu.yaml"

    assert main(["pretrain", str(path), f"data_root={tmp_path}", f"cache_dir={tmp_path}"]) == 2
    assert str(tmp_path / "sst2" / "SST-2" / "train.tsv") in capsys.readouterr().err


def test_the_cli_pretrains_and_prints_progress_and_a_table(family, tmp_path, capsys) -> None:
    config, _ = family
    overrides = [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in tiny_family(config.data_root, tmp_path).items()]
    path = tmp_path / "tiny.yaml"
    path.write_text("model: gpt\n")

    assert main(["pretrain", str(path), *overrides, "depths=[1]"]) == 0

    captured = capsys.readouterr()
    assert "tok/s" in captured.err and "loss" in captured.err
    assert "tiny:1" in captured.out and "val loss" in captured.out


@pytest.fixture(scope="module")
def vit_family(tmp_path_factory):
    """A 1-block ViT family pretrained on the fake CIFAR zip's classes 0-4: (data root, cache, card)."""
    from tests.pretrain_fixtures import write_cifar_zip

    base = tmp_path_factory.mktemp("vit_family")
    values = tiny_family(write_cifar_zip(base / "data"), base / "cache", family="tinyvit", model="vit", depths=[1],
                         patch_size=8, corpus="cifar10_jpeg_0_4", budget=12, warmup_steps=1, eval_fraction=0.25)
    (card,) = pretrain(build_dataclass(PretrainConfig, values, ""))
    return base / "data", base / "cache", card


def test_a_vit_family_pretrains_on_cifar_classes_0_to_4_and_starts_a_10_class_model(vit_family) -> None:
    from hfl.models.family import load_family_weights
    from hfl.models.vit import ViT

    _, cache, card = vit_family

    assert card["shape"] == {"model": "vit", "depth": 1, "dim": 16, "heads": 2, "patch_size": 8, "image_size": 32,
                             "in_channels": 3, "num_classes": 5}
    assert card["images_seen"] == 12 and card["tokens_seen"] == 12 * 16
    assert card["corpus"]["classes"] == [0, 1, 2, 3, 4] and card["corpus"]["val_images"] == 5
    saved = load_file(weights_path(cache, "tinyvit", 1))
    ten = ViT(3, 10, patch_size=8, dim=16, depth=1, heads=2)
    report = load_family_weights(ten, "tinyvit:1", cache, "vit")
    assert {key for key, _ in report.skipped} == {"head.fc.weight", "head.fc.bias"}  # 5 pretrained classes, 10 now
    assert all(torch.equal(ten.state_dict()[k], saved[k]) for k in report.loaded) and len(report.loaded) == len(saved) - 2


def test_a_task_on_other_classes_gets_a_new_classifier_and_one_on_the_same_classes_the_pretrained_one(vit_family) -> None:
    """CAFF's downstream head is new (ImageNet -> CIFAR); a head pretrained on classes 0-4 would read
    a dog as label 3, which in the 5-9 task is a ship."""
    from hfl.experiment import family_loader, task_labels
    from hfl.data.datasets import load_dataset
    from hfl.models.vit import ViT

    root, cache, _ = vit_family
    saved = load_file(weights_path(cache, "tinyvit", 1))

    def start(classes: tuple[int, ...]) -> tuple[ViT, ViT]:
        data = load_dataset("cifar10_jpeg", str(root), str(cache), classes=classes)
        config = SimpleNamespace(model=ModelConfig(name="vit", pretrained="tinyvit:1"),
                                 data=SimpleNamespace(name="cifar10_jpeg", classes=classes, cache_dir=str(cache)))
        torch.manual_seed(0)
        fresh = ViT(3, 5, patch_size=8, dim=16, depth=1, heads=2)
        model = ViT(3, 5, patch_size=8, dim=16, depth=1, heads=2)
        model.load_state_dict(fresh.state_dict())
        family_loader(config, task_labels(config, data))(model, 1)  # as CAFF loads the member it picks
        return model, fresh

    other, fresh = start((5, 6, 7, 8, 9))
    assert torch.equal(other.head.fc.weight, fresh.head.fc.weight) and torch.equal(other.head.fc.bias, fresh.head.fc.bias)
    assert torch.equal(other.head.norm.weight, saved["head.norm.weight"])  # only the classifier is task-specific
    assert torch.equal(other.body[0].mlp.fc1.weight, saved["body.0.mlp.fc1.weight"])

    same, _ = start((0, 1, 2, 3, 4))
    assert torch.equal(same.head.fc.weight, saved["head.fc.weight"]) and torch.equal(same.head.fc.bias, saved["head.fc.bias"])


def test_the_load_says_why_a_classifier_kept_its_initialisation(vit_family) -> None:
    from hfl.models.family import load_family_weights
    from hfl.models.vit import ViT

    _, cache, _ = vit_family
    report = load_family_weights(ViT(3, 5, patch_size=8, dim=16, depth=1, heads=2), "tinyvit:1", cache, "vit",
                                 ("cifar10_jpeg", (5, 6, 7, 8, 9)))

    assert dict(report.skipped) == {
        key: "pretrained to predict classes 0, 1, 2, 3, 4 of cifar10_jpeg, the task's are classes 5, 6, 7, 8, 9 of cifar10_jpeg"
        for key in ("head.fc.weight", "head.fc.bias")
    }


PRETRAIN_CONFIGS = sorted((ROOT / "experiments" / "pretrain").glob("*.yaml"))
"""Not experiments (tests/test_experiments.py leaves them out): each is a family `hfl pretrain` builds."""


@pytest.mark.parametrize("path", PRETRAIN_CONFIGS, ids=lambda p: p.stem)
def test_every_pretraining_config_loads_at_caffs_shapes(path) -> None:
    from hfl.pretrain import estimate_cpu_seconds, load_pretrain_config

    config = load_pretrain_config(path)

    assert config.family == path.stem and config.depths == (3, 6, 9, 12)
    if config.model == "gpt":
        assert (config.dim, config.heads, config.context, config.lr, config.min_lr) == (96, 3, 256, 5e-4, 5e-5)
    else:
        assert (config.dim, config.heads, config.patch_size, config.lr, config.min_lr) == (192, 6, 4, 1e-4, 1e-5)
    assert config.betas == (0.9, 0.95) and config.weight_decay == 0.1
    if path.stem.endswith("_cpu"):  # "about an hour on a 2-core CPU", from the measured rates
        assert 50 * 60 <= estimate_cpu_seconds(config) <= 65 * 60


def test_the_experiment_model_is_loaded_for_the_tasks_classes(vit_family, monkeypatch) -> None:
    import hfl.models.build
    from hfl.data.datasets import load_dataset

    root, cache, _ = vit_family
    seen = []
    monkeypatch.setattr(hfl.models.build, "load_family_weights", lambda *args: seen.append(args[-1]))
    data = load_dataset("cifar10_jpeg", str(root), str(cache), classes=(5, 6, 7, 8, 9))
    config = SimpleNamespace(model=ModelConfig(name="vit_caff_l3", norm="bn", pretrained="vit_cpu:3"),
                             data=SimpleNamespace(name="cifar10_jpeg", classes=(5, 6, 7, 8, 9), cache_dir=str(cache)))

    build_model_for(config, data)

    assert seen == [("cifar10_jpeg", (5, 6, 7, 8, 9))]
