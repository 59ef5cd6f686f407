"""Experiment assembly: the per-process client environment a config builds (data, partitions, model,
method, budgets) and the models built for it. Every backend trains its clients in one of these."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from hfl.accounting.accountant import Accountant, CostScopes, optimizer_kind
from hfl.accounting.amounts import ClientBudget
from hfl.accounting.budgets import assign_budgets
from hfl.accounting.cost import sparse_weight_saving
from hfl.client import (
    SHUFFLE_STREAM,
    ClientBatches,
    fit_fast,
    train_client,
    train_clients_together,
    trains_together,
)
from hfl.config import ExperimentConfig, FLConfig
from hfl.data import (
    BatchTransform,
    ImageDataset,
    TokenDataset,
    TokenWindows,
    load_dataset,
    partition,
)
from hfl.errors import ConfigError
from hfl.methods.base import Method, Resources
from hfl.models import ScalableModel, build_model, is_family_source
from hfl.models.family import ClassLabels, load_family_weights, resolve_source
from hfl.registry import METHODS, import_class, import_plugins
from hfl.seeding import (
    PARTITION_STREAM,
    SERVER_SPLIT_STREAM,
    aside_from_torch_stream,
    derive_seed,
)
from hfl.simulation.devices import deadline_budgets
from hfl.submodel.spec import SubmodelSpec
from hfl.types import ClientTask, ClientUpdate, StateDict, TrainSettings

if TYPE_CHECKING:
    from hfl.lightning_client import LightningClient

log = logging.getLogger(__name__)


def server_split(num_samples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(server indices, client indices) of the training set: a seeded `fraction` for the server."""
    if fraction == 0:
        return np.zeros(0, dtype=np.int64), np.arange(num_samples)
    order = np.random.default_rng(seed).permutation(num_samples)
    cut = round(fraction * num_samples)
    return np.sort(order[:cut]), np.sort(order[cut:])


def partition_clients(config: ExperimentConfig, labels: np.ndarray, server_indices: np.ndarray, client_pool: np.ndarray) -> list[np.ndarray]:
    """The clients' shares of `client_pool` (indices into `labels`); what the data cannot give is a ConfigError."""
    d, clients = config.data, config.fl.clients
    if d.server_fraction > 0 and not len(server_indices):
        raise ConfigError("data.server_fraction", d.server_fraction, f"0, or a share of the {len(labels)} training samples of {d.name} that leaves the server at least one")
    if clients > len(client_pool):
        kept = f" (data.server_fraction keeps {len(server_indices)} of {len(labels)} for the server)" if len(server_indices) else ""
        raise ConfigError("fl.clients", clients, f"at most the {len(client_pool)} training samples of {d.name} the clients share{kept}")
    try:
        return partition(d.partition, labels[client_pool], clients, seed=derive_seed(config.seed, PARTITION_STREAM),
                         alpha=d.alpha, labels_per_client=d.labels_per_client)
    except ValueError as error:  # a partitioner's own limits (pathological: labels per client, samples per label)
        raise ConfigError("data.partition", d.partition, f"a partition {d.name} allows: {error}") from None


def natural_clients(config: ExperimentConfig, data: TokenDataset) -> TokenDataset:
    """The dataset's own clients that take part: `fl.clients` of them, a subset drawn with the seed
    (kept in the dataset's order), or all of them; more is a ConfigError."""
    d, clients, available = config.data, config.fl.clients, len(data.clients)
    if clients > available:
        raise ConfigError("fl.clients", clients, f"at most the {available} clients of {d.name} (its speaking roles with "
                          f"text for a training and a test window at data.seq_len={d.seq_len})")
    if d.augment not in ("auto", "none"):
        raise ConfigError("data.augment", d.augment, f"auto or none for {d.name}: token windows are not augmented")
    if clients == available:
        return data
    chosen = np.random.default_rng(derive_seed(config.seed, PARTITION_STREAM)).choice(available, size=clients, replace=False)
    return data.select(np.sort(chosen).tolist())


def train_settings(fl: FLConfig, round_: int) -> TrainSettings:
    """What a client-round of round `round_` trains with: the round's learning rate and every other `fl` training setting."""
    return TrainSettings(fl.lr_at(round_), fl.momentum, fl.weight_decay, fl.local_epochs, fl.batch_size, fl.optimizer, fl.lr,
                         fl.precision, fl.gradient_clip_val, fl.gradient_clip_algorithm, fl.agc, fl.accumulate_grad_batches, fl.callbacks)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("backend.device", name, "cpu or auto: CUDA is not available on this machine")
    return torch.device(name)


def uses_cudnn(config: ExperimentConfig) -> bool:
    """Whether clients on CUDA run cuDNN's convolutions (`backend.cudnn` auto or on)."""
    return config.backend.cudnn != "off"


def cuda_headroom_bytes(config: ExperimentConfig) -> int:
    """What a client's estimated peak counts beyond its tensors (`backend.cuda_headroom_mib`): where
    clients with budgets train on CUDA, under the allocator's cap of their budget; else 0."""
    return config.backend.cuda_headroom_mib * 2**20 if config.budgets.enabled and clients_train_on_cuda(config) else 0


def configure_cudnn(config: ExperimentConfig) -> None:
    """Set this process's cuDNN as `backend.cudnn` asks: heuristic plan choice (no timing search,
    whose trial workspaces would count against a client's cap) and, under auto, deterministic plans."""
    choice = config.backend.cudnn
    torch.backends.cudnn.enabled = choice != "off"
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = choice == "auto"


def clients_train_on_cuda(config: ExperimentConfig) -> bool:
    """Whether clients train on a GPU: asked for, or auto where this process sees one or the Ray
    actors reserve GPUs (a CPU head plans for GPU workers)."""
    backend = config.backend
    if backend.device != "auto":
        return backend.device == "cuda"
    ray_gpus = backend.name == "ray" and (backend.num_gpus_per_client > 0 or bool(backend.gpu_memory))
    return ray_gpus or torch.cuda.is_available()


ALLOCATOR_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""Environment variables through which a user configures torch's caching allocator; hfl leaves it as they set it."""


def use_expandable_segments() -> None:
    """Let CUDA's caching allocator grow its segments in place (`expandable_segments`) unless the
    user configured the allocator. Without it, a cached block up to 1 MiB larger than a request is
    handed out whole and counted whole by `torch.cuda.max_memory_allocated`, so a client measured
    (and capped, see `cap_client_memory`) up to 1 MiB per live tensor above what its
    tensors hold: PreResNet-20 0.78 MiB above the estimate, the ViT up to 12 MiB (issue 35).
    With it, the allocator splits off exactly what was asked (in 512-byte units). The setting is
    torch's own (PYTORCH_ALLOC_CONF); set here because a process may have used CUDA before."""
    if any(name in os.environ for name in ALLOCATOR_SETTINGS):
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9; older: the cuda one
    (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")


@contextlib.contextmanager
def cap_client_memory(env: ClientEnvironment, task: ClientTask) -> Iterator[None]:
    """On CUDA, while a budgeted client trains, let this process allocate at most the client's
    memory budget beyond what it holds for everything else (the data, other shapes' models): a
    client whose training exceeds its budget fails with an out-of-memory error instead of borrowing
    the device's memory, and cuDNN, whose workspace is no tensor the estimate sees, falls back to
    plans whose workspace fits (PyTorch tries the next plan when a workspace allocation fails).

    The budget covers the client model's weights, as the estimate and the measurement do. The
    allocator holds its cap against the memory it has reserved, which exceeds what is allocated by
    its fragmentation (free parts of partly used 2 MiB pages: 25-41 MiB at the peak for FeDepth's
    clients at batch 128 on an H200, `benchmarks/gpu_memory_cap.py`). So the cap starts from what
    the process has reserved: started from what it had allocated, it failed every one of 30 FeDepth
    client-rounds whose tensors fit their budgets, and 13-17 of 30 with 16 MiB more. The price is
    that a client may fill free parts of pages the process already held, so its measured (allocated)
    peak can exceed its budget: FeDepth's clients measured up to 1.26x their budgets in float32 and
    1.47x in bf16, above their estimates by what cuDNN's workspace takes without budgets too
    (benchmarks/RESULTS.md, fifth lease). The cache is emptied first, so that free cached segments
    do not count against the cap. The cap is lifted afterwards, for the server's evaluation and the
    next client's set-up."""
    budget = task.ctx.budget.memory_bytes if task.ctx.budget else None
    if env.device.type != "cuda" or budget is None:
        yield
        return
    # An index: set_per_process_memory_fraction refuses a bare torch.device("cuda").
    device = env.device.index if env.device.index is not None else torch.cuda.current_device()
    model = env.model(task.spec)  # built first: its weights are part of the budget
    model.zero_grad(set_to_none=True)  # a failed client's gradients must not count as held
    torch.cuda.empty_cache()
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    held = torch.cuda.memory_reserved(device) - weights
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(held + budget, 1) / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def warm_up_cuda(device: torch.device) -> None:
    """Start cuBLAS (and cuBLASLt) and cuDNN on `device` with one small training step. Their
    handles and persistent workspaces (cuBLAS keeps one per stream, several MiB) belong to the
    process: allocated by whichever client came first, they would count in that client's measured
    peak and, under a budget cap (Ray), fail it."""
    x = torch.randn(2, 3, 8, 8, device=device, requires_grad=True)
    conv = nn.Conv2d(3, 4, 3).to(device)
    linear = nn.Linear(4 * 6 * 6, 4).to(device)
    h = linear(conv(x).flatten(1))
    (h @ h.T).sum().backward()
    torch.cuda.synchronize(device)


@dataclass
class ClientEnvironment:
    """Everything a worker process needs to train any client, built once from the config."""

    config: ExperimentConfig
    data: ImageDataset | TokenDataset
    """The dataset; for text, only the clients taking part (`natural_clients`)."""
    partitions: list[Tensor]
    transform: BatchTransform | None
    """Applied per training batch; None when nothing is augmented and `train_x` is pre-normalised
    (or holds token ids, which are never transformed)."""
    method: Method
    device: torch.device
    train_x: Tensor | TokenWindows
    train_y: Tensor | TokenWindows
    test_x: Tensor | TokenWindows
    """Normalised once: evaluation reads it every round."""
    test_y: Tensor | TokenWindows
    accountant: Accountant
    budgets: list[ClientBudget | None]
    """Every client's budget (None: unlimited), fixed for the run."""
    _models: dict[tuple, nn.Module] = field(default_factory=dict)
    _classes: dict[int, Tensor] = field(default_factory=dict)
    """The labels present in each client's data."""

    @classmethod
    def from_config(cls, config: ExperimentConfig, device: torch.device | None = None) -> ClientEnvironment:
        import_plugins(config.plugins)  # a Ray actor's config arrives pickled: its plug-ins are not imported yet
        device = device or resolve_device(config.backend.device)
        if config.fl.precision == "16-mixed" and device.type != "cuda":  # Lightning would silently train bf16 instead
            raise ConfigError("fl.precision", config.fl.precision, "32-true or bf16-mixed where clients train on the CPU "
                              "(float16 autocast with a gradient scaler needs CUDA)")
        for path in config.fl.callbacks:  # before any data is loaded: a typo fails in a second
            import_class(path, "fl.callbacks")
        torch.set_num_threads(config.backend.threads)
        if device.type == "cuda":
            configure_cudnn(config)
            use_expandable_segments()
            warm_up_cuda(device)
        d = config.data
        if is_family_source(config.model.pretrained):  # before any data is loaded: a missing family names the command that builds it
            resolve_source(config.model.pretrained, d.cache_dir)
        data = load_dataset(d.name, d.root, d.cache_dir, d.download, test_fraction=d.test_fraction, classes=d.classes, seq_len=d.seq_len, stride=d.stride)
        transform: BatchTransform | None = None
        if isinstance(data, TokenDataset):  # token ids go to the model as they are: nothing to normalise or augment
            with torch.device("meta"):  # a model that cannot read the windows fails here, before the clients are counted
                build_model_for(config, data)
            data = natural_clients(config, data)
            parts = data.client_indices()
            server_indices, client_pool = np.zeros(0, dtype=np.int64), np.arange(len(data.train_x))
            augment = "none"
            train_x = data.train_x.to(device)
        else:
            labels = data.train_y.numpy()
            server_indices, client_pool = server_split(len(labels), d.server_fraction, derive_seed(config.seed, SERVER_SPLIT_STREAM))
            parts = partition_clients(config, labels, server_indices, client_pool)
            augment = data.default_augment if d.augment == "auto" else d.augment
            transform = BatchTransform(data.mean, data.std, augment, device)
            train_x = data.train_x.to(device)
            if augment == "none":  # normalise once instead of every batch of every round
                train_x = transform(train_x, train=False)
        accountant = accountant_for(config, data)
        _, budgets = assign_budgets(config, accountant, [len(p) for p in parts])  # fixed for the run
        budgets = deadline_budgets(config, budgets)
        test_x = data.test_x.to(device) if transform is None else transform(data.test_x.to(device), train=False)
        unlabelled = None
        if len(server_indices):
            unlabelled = train_x[torch.as_tensor(server_indices, device=device)]
            unlabelled = unlabelled if augment == "none" else transform(unlabelled, train=False)
        resources = Resources(
            model=build_model_for(config, data),
            build=lambda width, norm=None: build_model_for(config, data, width, norm),
            accountant=accountant,
            budgets=tuple(budgets),
            batch_size=config.fl.batch_size,
            device=device,
            unlabelled_x=unlabelled,
            seed=config.seed,
            rounds=config.fl.rounds,
            local_epochs=config.fl.local_epochs,
            client_samples=tuple(len(p) for p in parts),
            load_member=family_loader(config, task_labels(config, data)),
        )
        method = METHODS.get(config.method.name, field="method.name")(config.method, resources)
        return cls(
            config=config,
            data=data,
            partitions=[torch.as_tensor(client_pool[p], dtype=torch.long) for p in parts],
            transform=None if augment == "none" else transform,
            method=method,
            device=device,
            train_x=train_x,
            train_y=data.train_y.to(device),
            test_x=test_x,
            test_y=data.test_y.to(device),
            accountant=accountant,
            budgets=budgets,
        )

    def model(self, spec: SubmodelSpec) -> nn.Module:
        """A client model of the spec's shape, built once per process and reused by every client."""
        if spec.shape not in self._models:
            with aside_from_torch_stream():
                self._models[spec.shape] = self.method.client_model(spec).to(self.device)
        return self._models[spec.shape]

    def batches(self, task: ClientTask) -> ClientBatches:
        """The client's mini-batches for this round, in its own seeded order."""
        ctx = task.ctx
        return ClientBatches(
            self.train_x,
            self.train_y,
            self.partitions[ctx.client_id],
            ctx.train.batch_size,
            self.transform,
            ctx.generator(SHUFFLE_STREAM),
        )

    def together_key(self, task: ClientTask) -> tuple | None:
        """Tasks with equal keys can train at once (`train_together`): same model structure, frozen
        tensors, training stages (FeDepth's block groups) and sample count; None for a task that must
        train alone."""
        if not trains_together(self.method, task):
            return None
        return (task.spec.shape, task.spec.frozen, task.stages, task.ctx.num_samples)

    def work_units(self, tasks: Sequence[ClientTask], batch_clients: int, spread: int = 1) -> list[list[int]]:
        """`tasks` (their indices) in the groups that train at once: each alone where `batch_clients`
        is 1 or a task cannot train beside others, else up to `batch_clients` of one `together_key`,
        cut into at least `spread` groups where there are that many tasks (one per Ray actor, so
        that batching never leaves an actor idle)."""
        units: list[list[int]] = []
        groups: dict[tuple, list[int]] = {}
        for i, task in enumerate(tasks):
            key = self.together_key(task) if batch_clients > 1 else None
            if key is None:
                units.append([i])
            else:
                groups.setdefault(key, []).append(i)
        for members in groups.values():
            size = min(batch_clients, -(-len(members) // spread))
            units.extend(members[lo : lo + size] for lo in range(0, len(members), size))
        return units

    def train_unit(self, global_state: StateDict, tasks: Sequence[ClientTask]) -> list[ClientUpdate]:
        """Train one of `work_units`: a task alone, or several of one `together_key` at once."""
        if len(tasks) == 1:
            return [self.train(global_state, tasks[0])]
        return self.train_together(global_state, tasks)

    def train_together(self, global_state: StateDict, tasks: Sequence[ClientTask]) -> list[ClientUpdate]:
        """Train tasks of one `together_key` as one vectorised model (see `train_clients_together`)."""
        model = self.model(tasks[0].spec)
        classes = [self.labels_of(t.ctx.client_id) for t in tasks]
        updates = train_clients_together(model, self.method, tasks, global_state, [self.batches(t) for t in tasks], classes)
        for task, update in zip(tasks, updates):
            update.metrics.update(self.cost_metrics(task))
        return updates

    def train(self, global_state: StateDict, task: ClientTask) -> ClientUpdate:
        model, batches, classes, peer = self._client_parts(task)
        fit = fit_fast
        if self.config.backend.trainer == "lightning" or task.ctx.train.callbacks:  # a Trainer runs callbacks
            from hfl.lightning_client import fit_lightning as fit  # only here: the import costs a second and 250 MiB
        with cap_client_memory(self, task):
            update = train_client(model, self.method, task, global_state, batches, fit, classes, peer)
        update.metrics.update(self.cost_metrics(task))
        return update

    def lightning_client(self, global_state: StateDict, task: ClientTask) -> LightningClient:
        """`task` as a client-round to fit with your own `lightning.Trainer`; its `update()` equals
        `train`'s (docs/extending.md, "A client-round under your own Trainer")."""
        from hfl.lightning_client import LightningClient

        model, batches, classes, peer = self._client_parts(task)
        return LightningClient(model, self.method, task, global_state, batches, classes, peer, self.cost_metrics(task))

    def _client_parts(self, task: ClientTask) -> tuple[nn.Module, ClientBatches, Tensor, Callable[[], nn.Module]]:
        """The model of the task's shape, the client's batches, the labels in its data, and a
        builder of peer models."""
        def peer() -> nn.Module:
            return self.method.client_model(task.spec).to(self.device)

        batches = self.batches(task)
        return self.model(task.spec), batches, self.labels_of(task.ctx.client_id), peer

    def labels_of(self, client: int) -> Tensor:
        """The labels present in `client`'s data (a partition never changes: found once per client)."""
        if client not in self._classes:
            self._classes[client] = torch.unique(self.train_y[self.partitions[client].to(self.device)])
        return self._classes[client]

    def cost_metrics(self, task: ClientTask) -> dict[str, object]:
        """The client-round's budget, estimated peak memory and FLOPs (cached per sub-model shape).
        A pruning method's client-round also has the estimated peak with its pruned weights held as
        a sparse client stores them (`estimated_sparse_peak_bytes`); `estimated_peak_bytes`, which
        budgets are checked against, holds them masked-dense, as hfl trains them."""
        ctx = task.ctx
        cost = self.method.training_cost(task, min(ctx.train.batch_size, ctx.num_samples))
        budget = ctx.budget
        masks = task.spec.masks
        return {
            "tier": budget.tier if budget else None,
            "budget_bytes": budget.memory_bytes if budget else None,
            "estimated_peak_bytes": cost.peak_bytes,
            **({"estimated_sparse_peak_bytes": cost.peak_bytes - sparse_weight_saving(self.method.model.state_dict(), masks)}
               if masks else {}),
            "flops": cost.train_flops_per_sample * ctx.num_samples * ctx.train.local_epochs,
            "budget_flops": budget.flops if budget else None,
            "budget_upload_bytes": budget.upload_bytes if budget else None,
        }


def model_norm(config: ExperimentConfig) -> str:
    """`model.norm`, with auto resolved to the method's preferred kind."""
    if config.model.norm == "auto":
        return METHODS.get(config.method.name, field="method.name").preferred_norm
    return config.model.norm


def family_loader(config: ExperimentConfig, labels: ClassLabels | None) -> Callable[[nn.Module, int], None] | None:
    """Loads member l of the family `model.pretrained=FAMILY:l` names into a model of depth l for a
    task predicting `labels`; None when the run starts from no family."""
    source = config.model.pretrained
    if not is_family_source(source) or source.endswith(".safetensors"):
        return None
    family = source.rsplit(":", 1)[0]
    return lambda model, depth: load_family_weights(model, f"{family}:{depth}", config.data.cache_dir, config.model.name, labels)


def task_labels(config: ExperimentConfig, data: ImageDataset | TokenDataset) -> ClassLabels | None:
    """The classes an image task predicts, (dataset, class id of each label); None for other data."""
    if not isinstance(data, ImageDataset):
        return None
    return config.data.name, tuple(config.data.classes) or tuple(range(data.num_classes))


SETTINGS_THAT_CHANGE_NO_MODEL = {"": ("name", "seed", "logging"), "data": ("root", "cache_dir", "download"),
                                 "fl": ("rounds", "lr", "lr_schedule", "lr_decay", "eval_every", "checkpoint_every", "eval_spill_dir")}
"""Settings that change no model a run measures: runs that differ only in them share measurements."""


def accountant_for(config: ExperimentConfig, data: ImageDataset | TokenDataset) -> Accountant:
    """The experiment's accountant, sharing its measurements with every experiment of this process
    that builds the same models: the scopes are the config less what changes no model."""
    modelled = dataclasses.asdict(config)
    for section, names in SETTINGS_THAT_CHANGE_NO_MODEL.items():
        for name in names:
            (modelled[section] if section else modelled).pop(name)
    plain = (config.model, model_norm(config), data.name, data.in_channels, task_labels(config, data))
    return Accountant(
        build=lambda width: build_model_for(config, data, width),
        input_shape=data.input_shape,
        num_classes=data.num_classes,
        optimizer=optimizer_kind(config.fl.optimizer, config.fl.momentum),
        weight_decay=config.fl.weight_decay,
        input_dtype=data.input_dtype,
        conv_workspace=clients_train_on_cuda(config) and not uses_cudnn(config),
        cuda_headroom=cuda_headroom_bytes(config),
        precision=config.fl.precision,
        autocast_lists="cuda" if clients_train_on_cuda(config) else None,
        shared_as=CostScopes(plain=repr(plain), method=repr((plain, modelled))),
    )


def build_model_for(
    config: ExperimentConfig, data: ImageDataset | TokenDataset, width: float | None = None, norm: str | None = None
) -> ScalableModel:
    """The experiment's model for `data`, at `width` and `norm` (default: the global model's); a
    model that cannot read the data (images for text, a sequence past its context) is a ConfigError."""
    m = config.model
    width = m.width if width is None else width
    # Narrower client models take their weights from the global state: only full width loads them.
    pretrained = m.pretrained if width == 1 else ""
    # A pretrained family lives in the cache dir (`hfl pretrain` wrote it there); torchvision's weights are a path.
    cache_dir = config.data.cache_dir if is_family_source(pretrained) else None
    model = build_model(m.name, data.in_channels, data.num_classes, width, norm or model_norm(config), pretrained, cache_dir, m.depth,
                        task_labels(config, data))
    if model.input_kind != data.input_kind:
        readers = "gpt" if data.input_kind == "tokens" else "any model but gpt"
        raise ConfigError("model.name", m.name, f"a model that reads {data.input_kind}, as {data.name} holds ({readers})")
    if isinstance(data, TokenDataset) and data.seq_len > model.context:
        raise ConfigError("data.seq_len", data.seq_len, f"at most the {model.context} positions {m.name} reads (its context)")
    return model
