"""Experiment configuration: frozen dataclasses, loaded from YAML plus dotted `key=value` overrides.

Every field has a docstring and every check lives in `__post_init__`, so a YAML file, a CLI override
and a Python caller all get the same error: the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import hfl.backends
import hfl.methods  # noqa: F401  (with hfl.data and hfl.models, these declare the names the config checks, importing no torch)
from hfl.accounting.amounts import SCENARIOS, absolute_amount, check_amount
from hfl.data import NATURAL, NATURAL_CLIENTS
from hfl.data.cache import default_cache_dir, default_data_root
from hfl.errors import ConfigError, check, check_choice
from hfl.models import NORMS
from hfl.models.sources import TORCHVISION_FILES, is_family_source
from hfl.registry import BACKENDS, DATASETS, METHODS, MODELS, PARTITIONERS, import_plugins
from hfl.yaml_loader import apply_overrides, build_dataclass, coerce, read_yaml_mapping

__all__ = [
    "BackendConfig", "BudgetsConfig", "DataConfig", "DevicesConfig", "ExperimentConfig", "FLConfig", "LoggingConfig", "ModelConfig",
    "apply_overrides", "build_dataclass", "config_from_dict", "dump_config", "experiment_values", "flatten",
    "load_config", "read_yaml_mapping",
]

@dataclass(frozen=True)
class DataConfig:
    name: str = "digits"
    """Dataset registry key: digits, mnist, fashion_mnist, cifar10, cifar100, svhn, cifar10_jpeg, synthetic (images) or
    shakespeare (LEAF's next-character task, a client per play role; `hfl.data.tokens`)."""
    root: str = field(default_factory=default_data_root)
    """Folder holding `<name>/` in torchvision's layout; default env HFL_DATA, else ~/.cache/hfl."""
    cache_dir: str = field(default_factory=default_cache_dir)
    """Writable folder for decoded datasets; default env HFL_CACHE, else ~/.cache/hfl."""
    download: bool = False
    """Allow torchvision to download a missing dataset (needs the network)."""
    partition: str = "dirichlet"
    """How training data is split over clients: iid, dirichlet (balanced sizes), dirichlet_unbalanced, pathological;
    natural for a dataset that brings its own clients (shakespeare), and only for one."""
    alpha: float = 0.5
    """Dirichlet concentration; smaller is more skewed."""
    labels_per_client: int = 2
    """Λ for the pathological partition: distinct labels per client."""
    augment: str = "auto"
    """Training augmentation: auto (the dataset's default), none, flip, crop_flip."""
    test_fraction: float = 0.2
    """Share held out as the test set, for datasets without a fixed split (digits, synthetic)."""
    server_fraction: float = 0.0
    """Share of the training set the server keeps, without labels, for methods that distil on the
    server (FedDF); clients are partitioned from the rest."""
    classes: tuple[int, ...] = ()
    """Class ids to keep, in train and test, relabelled 0..k-1 in the order given (e.g. [5, 6, 7, 8, 9]:
    CIFAR-10's dog, frog, horse, ship, truck); empty keeps every class. The model gets k outputs."""
    seq_len: int = 80
    """Text datasets (shakespeare): tokens per sample (LEAF's 80). A sample is a window of seq_len characters and
    its target the window shifted by one, the next character at every position (the GPT predicts them all);
    LEAF's split of each role's text also depends on it. At most the model's context (the GPT's 256)."""
    stride: int = 1
    """Text datasets: tokens between the starts of consecutive windows, in train and test. LEAF's 1 makes
    a local epoch 80 passes over a role's text (each character sits in 80 windows); seq_len gives one."""

    def __post_init__(self) -> None:
        check_choice("name", self.name, DATASETS.names())
        check_choice("partition", self.partition, [*PARTITIONERS.names(), NATURAL])
        if self.name in NATURAL_CLIENTS:
            check(self.partition == NATURAL, "partition", self.partition,
                  f"{NATURAL} for {self.name}: its clients come with the data (fl.clients picks that many of them)")
            check(self.server_fraction == 0, "server_fraction", self.server_fraction,
                  f"0 for {self.name}: every training sample belongs to one of its own clients")
        else:
            check(self.partition != NATURAL, "partition", self.partition,
                  f"one of {', '.join(PARTITIONERS.names())} for {self.name} ({NATURAL} is for datasets with their own clients: "
                  f"{', '.join(sorted(NATURAL_CLIENTS))})")
        check(self.seq_len >= 1, "seq_len", self.seq_len, "an integer >= 1")
        check(self.stride >= 1, "stride", self.stride, "an integer >= 1")
        check(self.stride == 1 or self.name in NATURAL_CLIENTS, "stride", self.stride, f"1 for {self.name}: only text datasets have windows")
        check(self.alpha > 0, "alpha", self.alpha, "a number > 0")
        check(self.labels_per_client >= 1, "labels_per_client", self.labels_per_client, "an integer >= 1")
        check_choice("augment", self.augment, ("auto", "none", "flip", "crop_flip"))
        check(0 < self.test_fraction < 1, "test_fraction", self.test_fraction, "a number in (0, 1)")
        check(0 <= self.server_fraction < 1, "server_fraction", self.server_fraction, "a number in [0, 1)")
        # Ids beyond the dataset's classes are refused when it is loaded: only then is their number known.
        check(len(self.classes) != 1 and len(set(self.classes)) == len(self.classes) and all(c >= 0 for c in self.classes),
              "classes", list(self.classes), "distinct class ids >= 0, at least two (empty: every class)")


TRANSFORMERS = ("gpt", "vit")
"""Name prefixes of the models a pretrained family (`hfl pretrain`) can start."""
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
ROUND_POLICIES = ("sync", "deadline", "overselect", "async")
"""`fl.round_policy`'s choices (hfl.simulation)."""
"""`fl.precision`'s choices: Lightning's names of float32 and of bfloat16 and float16 autocast."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = "cnn"
    """Model registry key: cnn, preresnet20, resnet18, resnet34, resnet56, resnet110, mobilenetv2
    (CIFAR variant), vit (6 blocks), vit_tiny (12 blocks), gpt (a 12-block character/byte language
    model whose vocabulary is the dataset's number of classes); CAFF's families, whose weights
    `hfl pretrain` builds: gpt_l3, gpt_l6, gpt_l9 (and gpt) and vit_caff_l3 ... vit_caff_l12."""
    width: float = 1.0
    """Width ratio of the global model (0.1667 gives the FeDepth paper's 'FedAvg x min r')."""
    norm: str = "auto"
    """Normalisation: bn (running statistics), static_bn (batch statistics only, as in HeteroFL), none
    (no normalisation layers, ReLU -> conv, as FedMef's NSConv models; not for the ViT, whose layer
    norms stay), or auto (the method's choice: static_bn for HeteroFL, FedRolex, FedDF and ScaleFL,
    none for FedMef, bn otherwise)."""
    pretrained: str = ""
    """Weights to start from. `FAMILY:L` (e.g. lm_cpu:3): the member with L blocks of a transformer
    family `hfl pretrain` wrote to `<data.cache_dir>/pretrained/FAMILY/` (gpt*, vit* models; shapes
    must match), or a path to such a `.safetensors` file. Otherwise torchvision's ImageNet weights to
    start resnet18/resnet34 from (NeFL's pre-trained runs): the `.pth` file, or a folder holding
    `resnet18-f37072fd.pth` / `resnet34-b627a593.pth` (torch's hub cache,
    `~/.cache/torch/hub/checkpoints`); never downloaded. Empty: random initialisation."""
    depth: int = 0
    """Body blocks, for a model built in several depths (gpt: CAFF's family is 3, 6, 9 and 12 blocks; any depth >= 1
    builds); 0: the model's own depth."""

    def __post_init__(self) -> None:
        check_choice("name", self.name, MODELS.names())
        check(0 < self.width <= 4, "width", self.width, "a number in (0, 4]")
        check(self.depth >= 0, "depth", self.depth, "an integer >= 0 (0: the model's own depth)")
        if self.depth:
            deep = [name for name in MODELS.names() if "depth" in inspect.signature(MODELS.get(name)).parameters]
            check(self.name in deep, "depth", self.depth, f"0 for {self.name}: only {', '.join(deep)} take a depth")
        check_choice("norm", self.norm, ("auto", *NORMS))
        if self.pretrained and is_family_source(self.pretrained):
            check(self.name.startswith(TRANSFORMERS), "pretrained", self.pretrained,
                  f"empty unless name is a transformer ({', '.join(n for n in MODELS.names() if n.startswith(TRANSFORMERS))}) "
                  f"for a pretrained family (name is {self.name})")
        elif self.pretrained:
            check(self.name in TORCHVISION_FILES, "pretrained", self.pretrained,
                  f"empty unless name is one of {', '.join(TORCHVISION_FILES)} (name is {self.name})")
            check(self.width == 1, "width", self.width, "1 when pretrained is set (the weights are full width)")
            check(self.norm != "none", "norm", self.norm, "auto, bn or static_bn when pretrained is set (the weights hold batch norms)")


@dataclass(frozen=True)
class FLConfig:
    rounds: int = 20
    """Communication rounds."""
    clients: int = 20
    """Number of clients the training data is split over; for a dataset with its own clients (data.partition=natural),
    how many of them take part: a subset drawn with the seed, at most all of them."""
    fraction: float = 1.0
    """Share of clients sampled each round (at least one)."""
    local_epochs: int = 1
    """Passes over its own data a client makes per round."""
    batch_size: int = 32
    """Client mini-batch size."""
    lr: float = 0.05
    """Client SGD learning rate at round 1."""
    momentum: float = 0.0
    """Client SGD momentum (the optimiser state is fresh every round)."""
    weight_decay: float = 0.0
    """Client weight decay."""
    optimizer: str = "sgd"
    """Client optimiser: sgd (with `momentum`) or adam."""
    lr_schedule: str = "constant"
    """Learning rate over rounds: constant, cosine (to 0 at the last round), step (x lr_decay at 1/2 and 3/4 of the rounds),
    exponential (x lr_decay every round: FedMef's 0.95)."""
    lr_decay: float = 0.1
    """Factor of each step of the step schedule."""
    eval_every: int = 1
    """Evaluate the global model every k rounds (and always after the last)."""
    checkpoint_every: int = 1
    """Write a resumable checkpoint every k rounds (and always after the last)."""
    sbn_samples: int = 4096
    """Training inputs (a fixed seeded sample) from which static batch-norm statistics are recomputed
    before each evaluation; 0: the whole training set, as HeteroFL does (slow on CPU for CIFAR)."""
    eval_mode: str = "standard"
    """How the test set is run through the model: standard (batched whole-model forward) or
    blockwise (FeDepth's memory-efficient inference: one block at a time over the whole set, only
    that block's weights on the device). Both give the same scores and report `inference_peak_bytes`."""
    eval_spill_dir: str = ""
    """blockwise: folder for the kept activations (one file per block, deleted once read); empty
    keeps them in host memory."""
    precision: str = "32-true"
    """Clients' training precision, in Lightning's names: 32-true (float32), bf16-mixed (bfloat16
    autocast: activations in bf16, weights, gradients and optimiser state in float32) or 16-mixed
    (float16 autocast with a dynamic gradient scaler; CUDA only). Budgets, `hfl budget` and the
    sub-model each client gets follow it: the accountant measures training under it. Evaluation
    stays float32."""
    gradient_clip_val: float = 0.0
    """Clip each client step's gradients at this value (Lightning's gradient_clip_val; 0: no clipping)."""
    gradient_clip_algorithm: str = "norm"
    """norm (the total 2-norm of the client's trainable gradients, clip_grad_norm_) or value (each
    entry, clip_grad_value_), as Lightning's gradient_clip_algorithm."""
    agc: float = 0.0
    """Unit-wise adaptive gradient clipping (Brock et al. 2021, NFNets) at this λ, before
    `gradient_clip_val`: each output unit's gradient g (a filter's, a row's; a bias or gain vector
    whole) is scaled down so that ‖g‖ / max(‖θ‖, 10⁻³) ≤ λ; never the classifier's (NFNets' 0.16 at
    batch sizes up to 4096; 0: off)."""
    accumulate_grad_batches: int = 1
    """A client step every k batches, on the mean of their losses' gradients (and at each epoch's last
    batch), as Lightning's accumulate_grad_batches."""
    callbacks: tuple[str, ...] = ()
    """Lightning callbacks run in every client's training, as importable classes built without
    arguments (`package.module:Class`, e.g. from a plug-in); clients with callbacks train under
    lightning.Trainer whatever `backend.trainer` says (the fast driver gives the same numbers)."""

    round_policy: str = "sync"
    """Which updates a server step aggregates, in simulated time (docs/time.md; every policy but sync
    needs `devices`): sync (every cohort member; the round lasts until the slowest finishes),
    deadline (members finishing after `deadline_s` are stragglers: dropped, their work still spent),
    overselect (`overselect` more members are sampled; the first to finish, as many as `fraction`
    gives, are aggregated) or async (FedBuff: `async_concurrency` clients train at once, each from the
    model current when it started; every `async_buffer` arrivals are one server step, each update
    weighted by 1/sqrt(1 + staleness); `rounds` counts server steps)."""
    deadline_s: float = 0.0
    """deadline: simulated seconds a round may last."""
    deadline_plans: bool = False
    """deadline: the deadline is also a time budget (docs/time.md): each client trains the largest
    sub-model of the method whose download, training and upload end within `deadline_s` on its
    device, as it does under memory and FLOPs budgets; a client none does sits the round out
    (skipped, nothing spent). Off: clients train what their other budgets allow and late ones are
    stragglers."""
    overselect: float = 0.3
    """overselect: extra share of clients sampled (0.3: 30 % more than `fraction` gives, rounded up)."""
    async_concurrency: int = 0
    """async: clients training at once; 0: as many as `fraction` gives."""
    async_buffer: int = 0
    """async: arrivals per server step (FedBuff's K); 0: half of `async_concurrency`, at least 1."""
    time_targets: tuple[float, ...] = ()
    """Test accuracies whose first simulated time summary.json reports (`time_to_accuracy`), e.g. [0.6, 0.8]."""
    time_points: tuple[float, ...] = ()
    """Simulated seconds at which summary.json reports the accuracy reached (`accuracy_at_time`: that of
    the last scored round ending by then), e.g. [30, 60]."""

    time_limit_s: float = 0.0
    """Simulated seconds a run may last (needs `devices`): the first round (async: server step) ending
    at or after them is the last, so runs under different policies and methods stop at the same
    simulated time; `rounds` stays the most it runs, and what `lr_schedule` counts. 0: no limit."""

    def __post_init__(self) -> None:
        check_choice("round_policy", self.round_policy, ROUND_POLICIES)
        check(self.deadline_s >= 0 and math.isfinite(self.deadline_s), "deadline_s", self.deadline_s, "a number of seconds >= 0")
        check((self.deadline_s > 0) == (self.round_policy == "deadline"), "deadline_s", self.deadline_s,
              "a number of seconds > 0 exactly when round_policy is deadline")
        check(isinstance(self.deadline_plans, bool), "deadline_plans", self.deadline_plans, "true or false")
        check(not self.deadline_plans or self.round_policy == "deadline", "deadline_plans", self.deadline_plans,
              "false unless round_policy is deadline (the deadline is the time budget)")
        check(0 < self.overselect <= 10, "overselect", self.overselect, "a number in (0, 10]")
        check(self.async_concurrency >= 0, "async_concurrency", self.async_concurrency, "an integer >= 0 (0: as many as fraction gives)")
        check(self.async_buffer >= 0, "async_buffer", self.async_buffer, "an integer >= 0 (0: half of async_concurrency)")
        check(all(0 < t <= 1 for t in self.time_targets), "time_targets", list(self.time_targets), "accuracies in (0, 1]")
        check(all(t > 0 and math.isfinite(t) for t in self.time_points), "time_points", list(self.time_points), "simulated seconds > 0")
        check(self.time_limit_s >= 0 and math.isfinite(self.time_limit_s), "time_limit_s", self.time_limit_s, "simulated seconds >= 0 (0: no limit)")
        for name in ("rounds", "clients", "local_epochs", "batch_size", "eval_every", "checkpoint_every"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        check(0 < self.fraction <= 1, "fraction", self.fraction, "a number in (0, 1]")
        check(self.sbn_samples >= 0, "sbn_samples", self.sbn_samples, "an integer >= 0 (0: all)")
        check(self.lr > 0, "lr", self.lr, "a number > 0")
        check(0 <= self.momentum < 1, "momentum", self.momentum, "a number in [0, 1)")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        check_choice("lr_schedule", self.lr_schedule, ("constant", "cosine", "step", "exponential"))
        check_choice("optimizer", self.optimizer, ("sgd", "adam"))
        check(0 < self.lr_decay <= 1, "lr_decay", self.lr_decay, "a number in (0, 1]")
        check_choice("eval_mode", self.eval_mode, ("standard", "blockwise"))
        check_choice("precision", self.precision, PRECISIONS)
        check(self.gradient_clip_val >= 0, "gradient_clip_val", self.gradient_clip_val, "a number >= 0 (0: no clipping)")
        check_choice("gradient_clip_algorithm", self.gradient_clip_algorithm, ("norm", "value"))
        check(self.agc >= 0, "agc", self.agc, "a number >= 0 (0: no adaptive gradient clipping)")
        check(self.accumulate_grad_batches >= 1, "accumulate_grad_batches", self.accumulate_grad_batches, "an integer >= 1")
        for path in self.callbacks:
            module, _, name = path.partition(":")
            check(bool(module) and name.isidentifier(), "callbacks", path, "importable classes written package.module:Class")
        check(not self.eval_spill_dir or self.eval_mode == "blockwise", "eval_spill_dir", self.eval_spill_dir,
              "empty unless eval_mode is blockwise")

    def ends_run(self, round_: int, simulated_end: float | None) -> bool:
        """Whether round `round_`, ending at `simulated_end` simulated seconds (None: no devices), is a run's last."""
        return round_ >= self.rounds or (simulated_end is not None and 0 < self.time_limit_s <= simulated_end)

    def lr_at(self, round_: int) -> float:
        """Learning rate for (1-based) round `round_`."""
        progress = (round_ - 1) / self.rounds
        if self.lr_schedule == "cosine":
            return self.lr * 0.5 * (1 + math.cos(math.pi * progress))
        if self.lr_schedule == "step":
            return self.lr * self.lr_decay ** ((progress >= 0.5) + (progress >= 0.75))
        if self.lr_schedule == "exponential":
            return self.lr * self.lr_decay ** (round_ - 1)
        return self.lr


@dataclass(frozen=True)
class BudgetsConfig:
    scenario: str = "none"
    """none; fair, lack or surplus (FeDepth: a quarter of the clients each gets the memory of training
    the full model at width 1/6,1/3,1/2,1 / 1/8,1/6,1/2,1 / 1/6,1/3,1/2,2); tiers (`memory` per tier,
    `shares`); per_client (`memory` per client)."""
    memory: tuple[str, ...] = ()
    """Memory budgets: `width:R` (training the configured model at width R costs), `256MB`, `1.5GiB`
    (MB/GB are 10^6/10^9 bytes, MiB/GiB 2^20/2^30) or a byte count."""
    flops: tuple[str, ...] = ()
    """Optional FLOPs budget, one per `memory` entry: `width:R` (training at width R) or a number, per
    `flops_per`."""
    flops_per: str = "round"
    """What a numeric `flops` budget bounds: a client-round (round), or one mini-batch (batch: CAFF's
    unit, appendix A, "GFLOPs required for a single mini-batch"), which bounds a client-round at
    budget × samples × local epochs / batch size, so that the client with the most data is not the
    most constrained."""
    upload: tuple[str, ...] = ()
    """Optional upload budget per round, one per `memory` entry: `width:R` (that model's bytes) or `10MB`."""
    shares: tuple[float, ...] = ()
    """tiers: share of the clients in each tier, summing to 1 (default equal)."""
    names: tuple[str, ...] = ()
    """tiers: a name per tier (default from the widths, else tier0, tier1, ...)."""

    def __post_init__(self) -> None:
        check_choice("scenario", self.scenario, ("none", *SCENARIOS, "tiers", "per_client"))
        check_choice("flops_per", self.flops_per, ("round", "batch"))
        custom = self.scenario in ("tiers", "per_client")
        check(bool(self.memory) == custom, "memory", list(self.memory), "a list of amounts exactly when scenario is tiers or per_client")
        for name in ("memory", "flops", "upload"):
            for amount in getattr(self, name):
                try:
                    check_amount(amount)
                except ValueError as error:
                    raise ConfigError(name, amount, str(error)) from None
        for name in ("flops", "upload", *(("shares", "names") if self.scenario == "tiers" else ())):
            values = getattr(self, name)
            check(not values or len(values) == len(self.memory), name, list(values), f"{len(self.memory)} entries, one per memory entry")
        if self.shares:
            check(self.scenario == "tiers", "shares", list(self.shares), "only with scenario=tiers")
            check(all(s > 0 for s in self.shares) and abs(sum(self.shares) - 1) < 1e-6, "shares", list(self.shares), "positive shares summing to 1")

    @property
    def enabled(self) -> bool:
        return self.scenario != "none"


@dataclass(frozen=True)
class DevicesConfig:
    """Every client's device, for simulated time (docs/time.md): none, one per budget tier, or a trace file."""

    source: str = "none"
    """none (no simulated time), tiers (`speed`, `down`, `up`: one entry per budget tier, or one entry
    for every client without budgets), trace (`trace` in hfl's format) or fedscale (`trace`: FedScale's
    device-capacity pickle; `behaviour`: its availability trace, optional)."""
    speed: tuple[str, ...] = ()
    """tiers: training speed in FLOP/s (e.g. 2e9), one per tier."""
    down: tuple[str, ...] = ()
    """tiers: download bandwidth in bytes per second (e.g. 1MB, 5e5), one per tier."""
    up: tuple[str, ...] = ()
    """tiers: upload bandwidth in bytes per second, one per tier."""
    energy_per_flop: tuple[float, ...] = ()
    """Optional joules per training FLOP (e.g. 1e-9): tiers: one per tier; trace, fedscale: one value
    for every device whose trace gives none. Empty: no energy is recorded (unless the trace gives it)."""
    energy_per_byte: tuple[float, ...] = ()
    """Optional joules per byte downloaded or uploaded (e.g. 1e-7), as `energy_per_flop`."""
    spread: float = 0.0
    """Sigma of a log-normal factor (median 1) drawn per client with the seed, multiplying its speed
    and, drawn apart, its bandwidths; 0: every client of a tier is alike."""
    trace: str = ""
    """trace: a JSON or CSV file in hfl's device format (docs/time.md), or `synthetic` for the
    100-device trace shipped with hfl (hfl/simulation/synthetic_trace.json)."""
    behaviour: str = ""
    """fedscale: FedScale's client behaviour (availability) trace, a pickle; empty: always online."""
    mapping: str = "auto"
    """trace: by_id (a trace device's id is a client id; every client needs one), cycle (client c gets
    the (c mod D)-th of the D devices in id order) or auto (cycle for `synthetic` and fedscale, else by_id)."""

    def __post_init__(self) -> None:
        check_choice("source", self.source, ("none", "tiers", "trace", "fedscale"))
        check_choice("mapping", self.mapping, ("auto", "by_id", "cycle"))
        tiers = self.source == "tiers"
        for name in ("speed", "down", "up"):
            values = getattr(self, name)
            check(bool(values) == tiers, name, list(values), "one amount per budget tier exactly when source is tiers")
            for amount in values:
                ok = not str(amount).startswith("width:")
                try:
                    check_amount(amount)
                except ValueError:
                    ok = False
                check(ok and absolute_amount(amount) > 0, name, amount, "a positive amount per second such as 2e9 or 1MB")
        check(len(self.down) == len(self.speed) == len(self.up), "down", list(self.down),
              f"as many entries as speed ({len(self.speed)}), and so up")
        for name in ("energy_per_flop", "energy_per_byte"):
            values = getattr(self, name)
            entries = f"{len(self.speed)} entries, one per tier as speed" if tiers else "one value for every device"
            check(not values or self.source != "none", name, list(values), "empty unless source is set (energy is a device's)")
            check(not values or len(values) == (len(self.speed) if tiers else 1), name, list(values), f"empty or {entries}")
            for value in values:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
                check(ok, name, value, "a number of joules >= 0")
        check(self.spread >= 0 and math.isfinite(self.spread), "spread", self.spread, "a number >= 0")
        check(bool(self.trace) == (self.source in ("trace", "fedscale")), "trace", self.trace,
              "a file (or synthetic) exactly when source is trace or fedscale")
        check(not self.behaviour or self.source == "fedscale", "behaviour", self.behaviour, "empty unless source is fedscale")

    @property
    def enabled(self) -> bool:
        return self.source != "none"


@dataclass(frozen=True)
class BackendConfig:
    name: str = "local"
    """Where clients train: local (in-process, one after another) or ray (actors, on one machine or a cluster)."""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda."""
    cudnn: str = "auto"
    """On CUDA, how convolutions run. auto: cuDNN with deterministic plans chosen by its heuristics
    (the same plans and numbers every run); on: cuDNN as PyTorch sets it up (nondeterministic plans
    allowed); off: no cuDNN: PyTorch's own CUDA convolution unfolds one image at a time (a GEMM per
    image and layer, 5x slower for PreResNet-20 at batch 32 on an H200) and the estimate counts its
    unfolded input. cuDNN's workspace is no tensor the estimate sees (uncapped, it took FeDepth's
    clients up to 3x their estimate at batch 128 on an H200): a budgeted client trains under a cap of
    its budget (`cuda_headroom_mib`), and cuDNN falls back to plans whose workspace fits."""
    cuda_headroom_mib: int = 4
    """With budgets, on CUDA: memory every client's estimate counts beyond its tensors, so that a
    client that fits by the estimate also fits under the allocator's cap of its budget: the
    allocator reserves memory in 2 MiB pages, and cuDNN's workspace lives in what is left."""
    trainer: str = "fast"
    """Client loop: fast (hfl's lean driver of the client module's Lightning hooks; never imports
    Lightning) or lightning (the module as a LightningModule under lightning.Trainer; same results, slower)."""
    threads: int = 1
    """CPU threads per process for tensor ops. One suits simulated clients: on 2 cores a small CNN
    ran 4x slower with 2 threads (spin-waiting on tiny ops). Raise it for large models on CPU."""
    num_cpus_per_client: float = 1.0
    """ray: CPUs each client actor reserves; a pool holds as many actors as the nodes that can host it allow."""
    actors_per_pool: int = 0
    """ray: at most this many actors per pool (per budget tier on a tiered cluster); 0 sizes pools
    by what the nodes advertising the tier (their CPUs, GPUs and tier units) can host."""
    num_gpus_per_client: float = 0.0
    """ray, on GPUs: the share of a GPU each client actor reserves, so 1/n runs n clients at once on
    one GPU; 0: the client's memory budget over the GPU's memory (a whole GPU without budgets). Applies
    to the tiers whose nodes have GPUs; a tier whose nodes have none runs on CPU actors."""
    num_gpus_per_tier: tuple[str, ...] = ()
    """ray, on GPUs: TIER:SHARE rules (e.g. [large:0.5, small:0.125]) that set one tier's GPU share,
    over num_gpus_per_client and the budget; SHARE 0 runs that tier on CPU actors."""
    tier_strict: bool = False
    """ray: where no live node advertises a tier (`hfl_tier_<name>`), stop the run with one line and the
    command that resumes it, instead of running that tier's clients on CPU actors of other nodes."""
    batch_clients: int = 1
    """local and ray: train up to this many clients of the same sub-model shape at once, as one
    vectorised model (torch.func.vmap); 1 trains one after the other. Faster for small models on a
    GPU and on the CPU alike. Only for methods whose objective is marked vectorisable (FedAvg,
    FedAvg x r, FedProx, DepthFL, HeteroFL, FedRolex, ScaleFL, NeFL, SplitMix, FeDepth stage by stage:
    clients of one layout of block groups); others run one by one. Equal to sequential
    training up to float rounding (see docs/performance.md)."""
    client_timeout_s: float = 0.0
    """ray: a client-round running longer is stopped and recorded as failed; 0 waits forever."""
    actor_start_timeout_s: float = 300.0
    """ray: how long a pool waits for its client actors to start (a cluster may be scaling up). Past
    it the pool goes on with the actors that started, and the run stops with an error naming what
    they asked for if none did and no node can host one (more CPUs per client than the cluster has);
    before the first round, while a node can host one, it waits for the first to finish booting,
    however slow the machine. 0 waits forever."""
    gpu_memory: str = ""
    """ray: memory of one GPU of the cluster (e.g. 80GB), for num_gpus = budget / GPU memory; needed
    where the driver has no GPU (a CPU head) and budgets are set; default: the driver's GPU's memory
    on a one-node cluster."""
    ray_log_to_driver: bool = False
    """ray: show the actors' log lines in this process."""
    head_grace_s: float = 15.0
    """ray: how long the cluster's head (its GCS) may stop answering before the run stops, saying how
    to resume it: long enough for a GCS that restarts, well within the 60 s after which Ray ends a
    driver that lost it without a word."""
    chaos: tuple[str, ...] = ()
    """ray, for testing fault tolerance: ROUND:CLIENT:KIND rules (KIND raise, exit or hang) that make
    that client fail in that round."""

    def __post_init__(self) -> None:
        check_choice("name", self.name, BACKENDS.names())
        check_choice("cudnn", self.cudnn, ("auto", "on", "off"))
        check(self.cuda_headroom_mib >= 0, "cuda_headroom_mib", self.cuda_headroom_mib, "an integer >= 0 (MiB)")
        check(self.threads >= 1, "threads", self.threads, "an integer >= 1")
        check(self.num_cpus_per_client > 0, "num_cpus_per_client", self.num_cpus_per_client, "a number > 0")
        check(self.actors_per_pool >= 0, "actors_per_pool", self.actors_per_pool, "an integer >= 0")
        check(0 <= self.num_gpus_per_client <= 1, "num_gpus_per_client", self.num_gpus_per_client, "a number in [0, 1] (0: from the budget)")
        for rule in self.num_gpus_per_tier:
            tier, _, share = rule.rpartition(":")
            ok = bool(tier) and share.replace(".", "", 1).isdigit() and float(share) <= 1
            check(ok, "num_gpus_per_tier", rule, "TIER:SHARE with SHARE a number in [0, 1], e.g. large:0.5")
        check(self.batch_clients >= 1, "batch_clients", self.batch_clients, "an integer >= 1")
        check(self.client_timeout_s >= 0, "client_timeout_s", self.client_timeout_s, "a number >= 0 (0: no timeout)")
        if self.gpu_memory:
            try:
                check_amount(self.gpu_memory)
                ok = not self.gpu_memory.startswith("width:")
            except ValueError:
                ok = False
            check(ok, "gpu_memory", self.gpu_memory, "an amount of memory such as 24GB or 80GiB")
        check(self.actor_start_timeout_s >= 0, "actor_start_timeout_s", self.actor_start_timeout_s, "a number >= 0 (0: wait forever)")
        check(0 < self.head_grace_s < 60, "head_grace_s", self.head_grace_s, "seconds in (0, 60): Ray ends a driver whose head is gone for 60 s")
        for rule in self.chaos:
            parts = rule.split(":")
            ok = len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit() and parts[2] in ("raise", "exit", "hang")
            check(ok, "chaos", rule, "ROUND:CLIENT:KIND with KIND raise, exit or hang")
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_choice("trainer", self.trainer, ("fast", "lightning"))


@dataclass(frozen=True)
class LoggingConfig:
    wandb: bool = False
    """Log every round to Weights & Biases."""
    wandb_mode: str = "offline"
    """offline (default; sync later with `wandb sync`), online (needs a login) or disabled."""
    wandb_project: str = "hfl"
    """wandb project name."""
    wandb_group: str = ""
    """wandb group (e.g. a sweep name); empty for none."""
    wandb_checkpoint: bool = False
    """Also log the final checkpoint.pt as a wandb artifact (type model, alias final); offline it waits in
    OUT/wandb until `wandb sync`."""

    def __post_init__(self) -> None:
        check_choice("wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))


@dataclass(frozen=True)
class ExperimentConfig:
    name: str = "experiment"
    """A label for the run (output folder names, wandb run names)."""
    seed: int = 0
    """Seed of every random choice: data split, model init, cohorts, client shuffling."""
    plugins: tuple[str, ...] = ()
    """Your own modules to import before any name is checked (e.g. [my_project.methods]): they register methods,
    models, datasets or partitioners with `hfl.registry`'s decorators. They must be importable wherever the run
    goes (installed, or their folder on PYTHONPATH): Ray's workers import them too."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: Any = None
    """The method's own config dataclass, chosen by `method.name`."""
    fl: FLConfig = field(default_factory=FLConfig)
    budgets: BudgetsConfig = field(default_factory=BudgetsConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        check(self.seed >= 0, "seed", self.seed, "an integer >= 0")
        if self.method is None:
            object.__setattr__(self, "method", METHODS.get("fedavg").Config())
        if self.budgets.scenario == "per_client" and len(self.budgets.memory) != self.fl.clients:
            raise ConfigError("budgets.memory", list(self.budgets.memory), f"one amount per client ({self.fl.clients})")
        if self.fl.round_policy != "sync" and not self.devices.enabled:
            raise ConfigError("fl.round_policy", self.fl.round_policy, "sync unless devices are set (devices.source=tiers or trace)")
        if self.fl.time_limit_s and not self.devices.enabled:
            raise ConfigError("fl.time_limit_s", self.fl.time_limit_s, "0 unless devices are set (devices.source=tiers or trace): it counts simulated seconds")
        if self.devices.source == "tiers":
            tiers = budget_tier_count(self.budgets)
            check(len(self.devices.speed) == tiers, "devices.speed", list(self.devices.speed),
                  f"{tiers} entries, one per budget tier" + ("" if self.budgets.enabled else " (one for every client: no budgets are set)"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def budget_tier_count(budgets: BudgetsConfig) -> int:
    """How many tiers a budgets config makes (per_client: one per distinct entry; none: one)."""
    if budgets.scenario in SCENARIOS:
        return len(SCENARIOS[budgets.scenario])
    count = len(budgets.memory)
    if budgets.scenario == "per_client":
        return len(set(zip(budgets.memory, budgets.flops or [None] * count, budgets.upload or [None] * count)))
    return max(count, 1)


# -- loading -----------------------------------------------------------------------------------
SECTIONS = ("data", "model", "method", "fl", "budgets", "devices", "backend", "logging")


def config_from_dict(values: dict[str, Any]) -> ExperimentConfig:
    values = dict(values)
    import_plugins(coerce("plugins", values.get("plugins", ()), tuple[str, ...]))  # before the names they register are checked
    method_values = values.pop("method", None) or {}
    if not isinstance(method_values, dict):
        raise ConfigError("method", method_values, "a mapping with at least `name`")
    method_cls = METHODS.get(str(method_values.get("name", "fedavg")), field="method.name")
    method = build_dataclass(method_cls.Config, method_values, "method.")
    config = build_dataclass(ExperimentConfig, values, "")
    return dataclasses.replace(config, method=method)


def experiment_values(path: str | Path) -> dict[str, Any]:
    """The mapping of a YAML experiment file, named after the file unless it names itself."""
    path = Path(path)
    values = read_yaml_mapping(path, "config", "an experiment: data, model, method, fl, ... sections")
    if not values:  # every default would run: almost certainly the wrong file, or one not yet written
        raise ConfigError("config", str(path), f"an experiment with at least one of the sections {', '.join(SECTIONS)} (the file is empty)")
    values.setdefault("name", path.stem)
    return values


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> ExperimentConfig:
    """Read a YAML experiment file and apply dotted overrides."""
    return config_from_dict(apply_overrides(experiment_values(path), overrides))


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted paths: {"fl": {"lr": 0.1}} -> {"fl.lr": 0.1}."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def dump_config(config: ExperimentConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
