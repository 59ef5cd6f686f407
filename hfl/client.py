"""Client-side training: one generic module, `ClientModule`, that drives the method's objective
through Lightning's hook names (configure_optimizers, training_step, on_train_batch_end).

Two drivers run it with the same batches and the same optimiser, so they give the same weights:
`lightning` wraps it in a LightningModule that hands those hooks to it and fits that under a
`lightning.Trainer` (`hfl.lightning_client`); `fast` calls the same hooks itself (the automatic-
optimisation steps of Lightning, written out: zero_grad, training_step, backward, step, with the
Trainer's precision, gradient clipping and accumulation) without importing Lightning.
The fast driver exists because a Trainer costs tens of milliseconds to set up per fit, more than a
whole client-round of small models; `ClientModule` is a plain `nn.Module`, and Lightning is
imported only by the `lightning` driver, because the import costs a second or more and about
250 MiB of private memory in every process that trains clients (each Ray actor).

`train_clients_together` trains several clients of one sub-model shape as one vectorised model
(`torch.func.vmap` over their stacked weights): the same steps on the same batches, one kernel
launch for all of them, which is what fills a GPU when each client's model is small.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import cached_property, partial
from types import SimpleNamespace

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from hfl.accounting.cost import autocast_for, tensor_bytes
from hfl.data import BatchTransform
from hfl.methods.base import Method
from hfl.optim import ClientOptimizer
from hfl.pruning.nsconv import load_masks
from hfl.submodel.spec import SubmodelSpec, hold_rows, uploaded_keys
from hfl.types import ClientTask, ClientUpdate, StateDict, TrainSettings

SHUFFLE_STREAM = 1  # tag of the client's data-order random stream


def state_tensors(model: nn.Module) -> list[Tensor]:
    return [*model.parameters(), *model.buffers()]


class ClientBatches:
    """The mini-batches of one client: a fresh seeded permutation and augmentation every epoch."""

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        indices: Tensor,
        batch_size: int,
        transform: BatchTransform | None,
        generator: torch.Generator,
    ) -> None:
        """`transform` None: `x` is already normalised and nothing is augmented."""
        self.x, self.y, self.indices = x, y, indices
        self.batch_size, self.transform, self.generator = batch_size, transform, generator

    def __len__(self) -> int:
        return (len(self.indices) + self.batch_size - 1) // self.batch_size

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        order = self.indices[torch.randperm(len(self.indices), generator=self.generator)].to(self.x.device, non_blocking=True)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            x = self.x[idx]
            yield (x if self.transform is None else self.transform(x, train=True, generator=self.generator)), self.y[idx]


def client_optimizer(params: list[Tensor], settings: TrainSettings) -> ClientOptimizer:
    """The client's optimiser (`fl.optimizer`), in the multi-tensor (`foreach`) implementation on
    every device: the one CUDA picks by default and the accounting measures (on the CPU torch would
    loop over tensors, with the same results and smaller temporaries)."""
    return ClientOptimizer(params, settings.optimizer, settings.lr, settings.momentum, settings.weight_decay)


class _Objective(nn.Module):
    """The method's objective on `model` as a module's forward: under `functional_call` every part
    of `model` the objective walks (its forward, exits, blocks, head, hooks) runs on one client's
    weights."""

    def __init__(self, model: nn.Module, method: Method) -> None:
        super().__init__()
        self.model, self.method = model, method

    def forward(self, client: SimpleNamespace, x: Tensor, y: Tensor) -> Tensor:
        return self.method.objective(client, x, y)["loss"]


AGC_WEIGHT_FLOOR = 1e-3
"""ε of adaptive gradient clipping: a unit whose weights are smaller is clipped as if they had this
norm, so that units initialised at zero (biases, grown entries) can still move (NFNets' value)."""


def unit_norms(x: Tensor) -> Tensor:
    """2-norm of each output unit of a parameter, shaped to broadcast over it: of every slice along
    dim 0 (a filter, a linear layer's row); a vector or scalar (bias, gain) is one unit."""
    if x.dim() <= 1:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.dim())), keepdim=True)


def clip_adaptively(parameters: Iterable[Tensor], clipping: float) -> None:
    """Unit-wise adaptive gradient clipping (Brock et al. 2021, "High-Performance Large-Scale Image
    Recognition Without Normalization", NFNets), in place: every unit's gradient g is scaled to
    λ·max(‖θ‖, ε)/‖g‖ where ‖g‖ exceeds λ·max(‖θ‖, ε), so that no step moves a unit by more than the
    share λ of its norm (at the step's learning rate)."""
    for param in parameters:
        if param.grad is None:
            continue
        largest = unit_norms(param.detach()).clamp_min(AGC_WEIGHT_FLOOR) * clipping
        norm = unit_norms(param.grad)
        param.grad.mul_(torch.where(norm > largest, largest / norm.clamp_min(1e-6), 1.0))


def adaptively_clipped(models: Iterable[nn.Module]) -> list[Tensor]:
    """What `fl.agc` clips in a client's `models` (its model and peers): every trainable parameter
    but the classifiers' (NFNets leave the final linear layer unclipped)."""
    clipped = []
    for model in models:
        classifier = set(model.classifier_keys())
        clipped += [p for n, p in model.named_parameters() if p.requires_grad and n not in classifier]
    return clipped


class Precision:
    """What Lightning's precision plugins do around a training step, for the drivers that do not run
    a Trainer: autocast around the forward pass (`fl.precision` bf16-mixed and 16-mixed) and, for
    16-mixed, a dynamic gradient scaler that scales the loss, unscales the gradients before the
    step and skips steps whose gradients overflowed, as `lightning.pytorch.plugins.MixedPrecision`."""

    def __init__(self, precision: str, device: torch.device) -> None:
        self.precision, self.device_type = precision, device.type
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast_for(self.precision, self.device_type)

    def backward(self, loss: Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: ClientOptimizer, settings: TrainSettings, agc_parameters: Iterable[Tensor] = ()) -> None:
        """The optimiser step: gradients unscaled (16-mixed), those of `agc_parameters` clipped
        unit-wise (`fl.agc`), clipped (`fl.gradient_clip_val`) over the optimiser's parameters as
        Lightning's precision plugin clips them, then stepped."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        if settings.agc > 0:
            clip_adaptively(agc_parameters, settings.agc)
        if settings.gradient_clip_val > 0:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if settings.gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, settings.gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, settings.gradient_clip_val)
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()


class ClientModule(nn.Module):
    """Trains one client's sub-model with its method's objective, through LightningModule's hooks
    (run by `fit_fast`, or by a Trainer through `fit_lightning`'s adapter)."""

    def __init__(
        self,
        model: nn.Module,
        method: Method,
        task: ClientTask,
        classes: Tensor | None = None,
        peer: Callable[[], nn.Module] | None = None,
    ) -> None:
        """`peer` builds a fresh model of the task's shape, for the task's `peers`."""
        super().__init__()
        self.model, self.method, self.task = model, method, task
        if task.peers and peer is None:
            raise ValueError(f"the task asks for {task.peers} peer models but no builder was given")
        self.peers = nn.ModuleList(peer() for _ in range(task.peers))
        """Models trained beside `model` and never uploaded (m-FeDepth); trained stage by stage like it."""
        self.stage = 0
        """Index of the training stage running now (see `ClientTask.stages`)."""
        self.classes = classes
        """The labels present in this client's data (for objectives that mask the others)."""
        self.masks = {k: m.to(self.device_of_model()) for k, m in task.spec.masks.items()}
        """The element masks enforced after every optimiser step (the task's, until `replace_masks`)."""
        self.replaced_masks: dict[str, Tensor] = {}
        """Masks an objective replaced during the round; the update holds these instead of the task's."""
        self.loss_sum = torch.zeros((), device=self.device_of_model())
        self.steps = 0

    @cached_property
    def initial(self) -> dict[str, Tensor]:
        """The trainable weights the client started the round with (FedProx's w_t), copied when an
        objective first asks, which is before the first optimiser step."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if n not in self.task.spec.frozen}

    def device_of_model(self) -> torch.device:
        return next(self.model.parameters()).device

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def enter_stage(self, stage: int, trainable: frozenset[str] | None) -> None:
        """Train `trainable` (None: every parameter the spec does not freeze), the same names in every peer."""
        self.stage = stage
        frozen = self.task.spec.frozen
        for model in (self.model, *self.peers):
            model.zero_grad(set_to_none=True)  # the last stage's gradients would stay alive through this one
            for name, param in model.named_parameters():
                param.requires_grad_(name not in frozen and (trainable is None or name in trainable))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        terms = self.method.objective(self, *batch)
        self.loss_sum += terms["loss"].detach()  # summed on the device: no sync per step
        self.steps += 1
        return terms["loss"]

    def replace_masks(self, masks: Mapping[str, Tensor]) -> None:
        """Enforce `masks` instead of the current ones from this step's end on, and send the update
        with them: the hook through which a client changes its own sparsity pattern mid-round (FedDST's
        readjustment). Entries newly masked are zeroed after the optimiser step; newly unmasked ones
        are zero when the step starts, since they were masked until then."""
        for key, mask in masks.items():
            self.masks[key] = mask.to(self.device_of_model())
            self.replaced_masks[key] = mask.detach().cpu()
        load_masks(self.model, self.masks)

    def on_train_batch_end(self, *args: object) -> None:
        if self.masks:  # pruned entries stay zero
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for key, mask in self.masks.items():
                    if key in params:
                        params[key].mul_(mask)

    def configure_optimizers(self) -> ClientOptimizer:
        params = [p for model in (self.model, *self.peers) for p in model.parameters() if p.requires_grad]
        self.optimizer = client_optimizer(params, self.task.ctx.train)
        return self.optimizer

    def mean_loss(self) -> float:
        return float(self.loss_sum) / max(self.steps, 1)


def fit_fast(module: ClientModule, batches: ClientBatches, epochs: int) -> None:
    """Lightning's automatic optimisation, step for step, without a Trainer: the task's precision,
    gradient clipping and accumulation (a step every `accumulate_grad_batches` batches and at each
    epoch's last, on losses divided by that count) as a Trainer runs them."""
    optimizer = module.configure_optimizers()
    settings = module.task.ctx.train
    precision = Precision(settings.precision, module.device_of_model())
    every, last = settings.accumulate_grad_batches, len(batches) - 1
    module.train()
    for _ in range(epochs):
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(batches):
            with precision.autocast():
                loss = module.training_step(batch, i)
            precision.backward(loss / every if every > 1 else loss)
            if (i + 1) % every == 0 or i == last:
                precision.step(optimizer, settings, adaptively_clipped((module.model, *module.peers)) if settings.agc else ())
                optimizer.zero_grad(set_to_none=True)
            module.on_train_batch_end()


Fit = Callable[[ClientModule, ClientBatches, int], None]
"""A client driver: trains the module on its batches for so many epochs (`fit_fast`, or
`hfl.lightning_client.fit_lightning`, which imports Lightning)."""


def load_client(model: nn.Module, method: Method, task: ClientTask, global_state: StateDict) -> StateDict:
    """Load the client's sub-model from the global state; returns what it received."""
    received = method.client_state(global_state, task.spec)
    model.load_state_dict(received, strict=True)
    load_masks(model, task.spec.masks)
    return received


def client_extras(module: ClientModule, batches: ClientBatches) -> StateDict:
    """The method's uploads beside the weights, once training is over."""
    module.optimizer = None  # its state (momentum) must not stay alive beside the update's copies
    return module.method.client_uploads(module, batches)


def finish_client(module: ClientModule, received: StateDict, extras: StateDict, measured_peak: int | None, seconds: float) -> ClientUpdate:
    """What the trained `module` sends back: its weights, masks and rows as it holds them, and `extras`."""
    model, task, classes = module.model, module.task, module.classes
    model.zero_grad(set_to_none=True)
    trained = model.state_dict()
    held = task.spec
    if module.replaced_masks:
        held = replace(held, masks={**held.masks, **module.replaced_masks})
    if task.present_classes_only and classes is not None:
        held = hold_rows(held, trained, model.classifier_keys(), classes.cpu())
    return client_update(task, received, trained, module.mean_loss(), measured_peak, seconds, held, extras)


def train_client(
    model: nn.Module,
    method: Method,
    task: ClientTask,
    global_state: StateDict,
    batches: ClientBatches,
    fit: Fit = fit_fast,
    classes: Tensor | None = None,
    peer: Callable[[], nn.Module] | None = None,
) -> ClientUpdate:
    """Load the client's sub-model from the global state, train it with `fit`, and return what it sends back."""
    start = time.perf_counter()
    received = load_client(model, method, task, global_state)
    device = next(model.parameters()).device
    if device.type == "cuda":  # measure this client's training alone, beside the resident weights
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    # Every global-RNG draw (peer initialisation, dropout, user code) is seeded by the client-round,
    # so results do not depend on which clients ran before on this process.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(task.ctx.seed_for(0))
        module = ClientModule(model, method, task, classes, peer)
        for stage, trainable in enumerate(task.stages):
            module.enter_stage(stage, trainable)
            fit(module, batches, task.ctx.train.local_epochs)
        extras = client_extras(module, batches)
    measured_peak = None
    if device.type == "cuda":
        resident = sum(t.numel() * t.element_size() for t in state_tensors(model))
        measured_peak = torch.cuda.max_memory_allocated(device) - baseline + resident
    return finish_client(module, received, extras, measured_peak, time.perf_counter() - start)


def client_update(
    task: ClientTask,
    received: StateDict,
    trained: StateDict,
    train_loss: float,
    measured_peak: int | None,
    seconds: float,
    held: SubmodelSpec | None = None,
    extras: StateDict | None = None,
) -> ClientUpdate:
    """What a client sends back: the tensors of `trained` it uploads, and the client-round's metrics;
    `held`: the task's spec narrowed to what the update covers (default: the task's spec);
    `extras`: the method's `client_uploads`, sent (and counted) beside the weights."""
    spec = task.spec
    held = held or spec
    sent = {k: trained[k].detach().clone() for k in uploaded_keys(trained, spec)}
    extras = extras or {}
    metrics = {
        "id": task.ctx.client_id,
        "num_samples": task.ctx.num_samples,
        "train_loss": train_loss,
        "bytes_down": tensor_bytes(received, spec.masks),
        "bytes_up": tensor_bytes(sent, held.masks) + tensor_bytes(extras),
        "measured_peak_bytes": measured_peak,
        "submodel": spec.describe(),
        "level": task.level,
        "seconds": seconds,
    }
    return ClientUpdate(task.ctx.client_id, sent, float(task.ctx.num_samples), held, metrics, task.level, extras)


def trains_together(method: Method, task: ClientTask) -> bool:
    """Whether `task` can train vectorised beside others of its shape and stages: its objective is
    marked `vectorisable` (FedAvg's cross-entropy, FedProx's proximal term, DepthFL's and ScaleFL's
    exits and their distillation, SplitMix's bases, FeDepth's block groups), with nothing else per
    client (no peers, no masks, nothing narrowed by the client's labels, nothing uploaded beside the
    weights)."""
    objective = getattr(type(method).objective, "vectorisable", False)
    default = objective and type(method).client_uploads is Method.client_uploads
    # Classes narrowed by the client's labels (HeteroFL's masking trick) are per client, and kept.
    # 16-mixed's gradient scaler skips a step when any gradient overflowed, and clipping by norm
    # takes one norm over what the optimiser holds: stacked clients would skip and clip together
    # (adaptive clipping's units would take the stacking dimension for their filters).
    train = task.ctx.train
    per_client_step = train.precision == "16-mixed" or train.gradient_clip_val > 0 or train.agc > 0 or train.accumulate_grad_batches > 1 or train.callbacks
    return default and not (task.spec.masks or task.peers or per_client_step)


def train_clients_together(
    model: nn.Module,
    method: Method,
    tasks: Sequence[ClientTask],
    global_state: StateDict,
    batches: Sequence[ClientBatches],
    classes: Sequence[Tensor] | None = None,
) -> list[ClientUpdate]:
    """Train `tasks` (one sub-model shape, the same stages, equal sample counts, one round's settings,
    each `trains_together`; `classes`: the labels in each client's data) at once: their weights stacked
    along a new first dimension, the method's objective vectorised over it with `torch.func.vmap`, one
    optimiser over the stacked weights, stage by stage as `train_client` (a fresh optimiser over each
    stage's trainable weights: FeDepth's block groups).
    Every step takes each client's own next batch, so each client sees exactly the batches and
    updates it would see alone (SGD and Adam act element-wise); the results agree with
    `train_client`'s up to float rounding, since batched kernels sum in another order. Random
    draws inside the model (dropout) differ from one-by-one training. `model` lends its structure:
    its own weights are neither used nor changed."""
    start = time.perf_counter()
    device = next(model.parameters()).device
    if device.type == "cuda":  # the clients' peak together, shared out below: they hold alike
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    frozen = tasks[0].spec.frozen
    received = [method.client_state(global_state, task.spec) for task in tasks]
    parameter_names = {name for name, _ in model.named_parameters()}
    stacked = {k: torch.stack([r[k] for r in received]).to(device) for k in received[0]}
    params = {k: v for k, v in stacked.items() if k in parameter_names}
    buffers = {k: v for k, v in stacked.items() if k not in parameter_names}
    initial = {k: v.detach().clone() for k, v in params.items() if k not in frozen}
    # Each client's labels, padded to one length by repeating its first (the objective uses them as a set).
    longest = max((len(c) for c in classes), default=0) if classes is not None else 0
    labels = torch.stack([torch.cat([c, c[:1].expand(longest - len(c))]) for c in classes]).to(device) if longest else None
    objective = _Objective(model, method)

    def loss(stage: int, trained: Sequence[str], p: StateDict, b: StateDict, initial_weights: StateDict, client_labels: Tensor | None,
             x: Tensor, y: Tensor) -> Tensor:
        client = SimpleNamespace(model=model, peers=(), initial=initial_weights, task=tasks[0], stage=stage, classes=client_labels,
                                 trainable_parameters=lambda: [(n, p[n]) for n in trained])
        return functional_call(objective, {f"model.{k}": v for k, v in {**p, **b}.items()}, (client, x, y))

    settings = tasks[0].ctx.train
    precision = Precision(settings.precision, device)
    loss_sum = torch.zeros(len(tasks), device=device)
    steps = 0
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tasks[0].ctx.seed_for(0))
        for stage, trainable in enumerate(tasks[0].stages):
            names = [k for k in params if k not in frozen and (trainable is None or k in trainable)]
            for k, v in params.items():  # as `ClientModule.enter_stage`: only this stage's weights take gradients
                v.grad = None
                v.requires_grad_(k in names)
            optimizer = client_optimizer([params[k] for k in names], settings)
            vectorised = vmap(partial(loss, stage, names), in_dims=(0, 0, 0, None if labels is None else 0, 0, 0), randomness="different")
            for _ in range(settings.local_epochs):
                for pairs in zip(*batches, strict=True):
                    x, y = torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
                    optimizer.zero_grad(set_to_none=True)
                    with precision.autocast():
                        losses = vectorised(params, buffers, initial, labels, x, y)
                    precision.backward(losses.sum())
                    precision.step(optimizer, settings)
                    loss_sum += losses.detach()
                    steps += 1
    mean_losses = (loss_sum / max(steps, 1)).tolist()
    seconds = (time.perf_counter() - start) / len(tasks)
    measured_peak = None
    if device.type == "cuda":  # each client's share: they train the same shape on as many samples
        measured_peak = (torch.cuda.max_memory_allocated(device) - baseline) // len(tasks)
    updates = []
    for i, task in enumerate(tasks):
        trained = {k: v[i].detach() for k, v in stacked.items()}
        held = task.spec
        if task.present_classes_only and classes is not None:
            held = hold_rows(held, trained, model.classifier_keys(), classes[i].cpu())
        updates.append(client_update(task, received[i], trained, mean_losses[i], measured_peak, seconds, held))
    return updates
