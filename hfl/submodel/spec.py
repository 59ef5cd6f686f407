"""Sub-models as data: which entries of the global state a client holds, trains and sends back.

`extract(global_state, spec)` and `scatter(update, spec, global_state)` are the only operations that
move weights between the global model and a client.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from hfl.models.base import ScalableModel

Indices = Mapping[int, Tensor]
"""dimension -> the global indices (int64) a client holds along that dimension, in client order."""


@dataclass(frozen=True, eq=False)
class SubmodelSpec:
    """Per state key: indices kept along each dimension, absence, freezing and element masks."""

    width: float | None = None
    """Width ratio the client model is built at (None: the global model's); index lengths agree with it."""
    dropped_blocks: frozenset[int] = frozenset()
    """Body blocks the client model skips (depth scaling)."""
    depth: int | None = None
    """Leading body blocks the client model keeps (early-exit prefixes); None: all."""
    indices: Mapping[str, Indices] = field(default_factory=dict)
    """Keys absent here are held whole along every dimension."""
    absent: frozenset[str] = frozenset()
    """State keys the client does not hold (dropped blocks, exits it lacks)."""
    frozen: frozenset[str] = frozenset()
    """State keys the client holds but neither trains nor sends back."""
    masks: Mapping[str, Tensor] = field(default_factory=dict)
    """Boolean element masks in client shape: False entries are pruned (held as zero, never sent)."""
    prefix: str = ""
    """Where the client's model lives in the global state, for methods that keep several models
    there (Decoupled: `x0.5.` + key). The other fields name keys without it."""
    places: tuple[tuple[str, str], ...] = ()
    """(client prefix, global prefix) pairs, for a client model assembled from several models of
    the global state (SplitMix: client `bases.0.` + key is global `bases.3.` + key); used instead of
    `prefix`, and the other fields then name client keys, client prefixes included."""
    variant: tuple[tuple[str, Any], ...] = ()
    """(name, value) pairs of a method's own structure beyond width and depth, which its
    `client_model` builds (HetLoRA's adapter rank, FedHM's factor rank): part of the shape."""

    def __post_init__(self) -> None:
        if self.prefix and self.places:
            raise ValueError("a spec gives either one `prefix` or `places`, not both")

    @cached_property
    def shape(self) -> tuple:
        """What the client model's structure follows from: equal shapes, equal models (the key of
        model building, cost caching and model reuse). Indices, prefixes and masks only say which
        global entries fill the model; frozen tensors change what it costs, not what it is."""
        return (self.width, self.dropped_blocks, self.depth, self.absent, tuple(client for client, _ in self.places), self.variant)

    def _places(self) -> tuple[tuple[str, str], ...]:
        return self.places or (("", self.prefix),)

    def global_key(self, key: str) -> str:
        for client, glob in self._places():
            if key.startswith(client):
                return glob + key[len(client) :]
        raise KeyError(f"client key {key!r} lies under none of the spec's places {list(self.places)}")

    def client_items(self, global_state: Mapping[str, Tensor]) -> Iterable[tuple[str, Tensor]]:
        """(client key, global tensor) of every global entry under the prefix (or places)."""
        for client, glob in self._places():
            cut = len(glob)
            yield from ((client + k[cut:], v) for k, v in global_state.items() if k.startswith(glob))

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary for metrics."""
        return {
            "width": self.width,
            "dropped_blocks": sorted(self.dropped_blocks),
            "depth": self.depth,
            "frozen_tensors": len(self.frozen),
            "masked_tensors": len(self.masks),
            **dict(self.variant),
        }


def shape_model(model: ScalableModel, spec: SubmodelSpec) -> ScalableModel:
    """Give a freshly built model the spec's depth structure (skipped blocks, truncation)."""
    model.drop_blocks(spec.dropped_blocks)
    if spec.depth is not None:
        model.truncate(spec.depth)
    return model


def _region(shape: torch.Size, dims: Indices) -> tuple:
    """An index into a global tensor: basic slices when every kept range is a prefix (a view), else
    broadcastable index tensors for advanced indexing."""
    if all(bool((idx == torch.arange(len(idx))).all()) for idx in dims.values()):
        return tuple(slice(0, len(dims[d])) if d in dims else slice(None) for d in range(len(shape)))
    region = []
    for d, size in enumerate(shape):
        idx = dims[d] if d in dims else torch.arange(size)
        view = [1] * len(shape)
        view[d] = -1
        region.append(idx.view(view))
    return tuple(region)


def extract(global_state: Mapping[str, Tensor], spec: SubmodelSpec) -> dict[str, Tensor]:
    """The client's state: global entries at the spec's indices, masked entries zeroed."""
    out: dict[str, Tensor] = {}
    for key, tensor in spec.client_items(global_state):
        if key in spec.absent:
            continue
        dims = spec.indices.get(key)
        if dims:
            tensor = tensor[_region(tensor.shape, dims)]
        if key in spec.masks:  # masks live with the method's state on the CPU; the weights may be on a GPU
            tensor = tensor * spec.masks[key].to(tensor.device)
        out[key] = tensor
    return out


def uploaded_keys(client_state: Mapping[str, Tensor], spec: SubmodelSpec) -> list[str]:
    """Keys a client sends back: everything it holds except frozen tensors."""
    return [k for k in client_state if k not in spec.frozen]


def scatter(
    update: Mapping[str, Tensor], spec: SubmodelSpec, global_state: Mapping[str, Tensor]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Place an update in global shape: (values, coverage) by global key, zero where the client held nothing."""
    values = {key: torch.zeros_like(tensor) for key, tensor in global_state.items()}
    coverage = {key: torch.zeros_like(tensor, dtype=torch.bool) for key, tensor in global_state.items()}
    for key, tensor in spec.client_items(global_state):
        if key not in update:
            continue
        region = _region(tensor.shape, spec.indices.get(key) or {})
        held = spec.masks[key].to(tensor.device) if key in spec.masks else torch.ones_like(update[key], dtype=torch.bool)
        values[spec.global_key(key)][region] = update[key] * held
        coverage[spec.global_key(key)][region] = held
    return values, coverage


def hold_rows(spec: SubmodelSpec, client_state: Mapping[str, Tensor], keys: Iterable[str], rows: Tensor) -> SubmodelSpec:
    """`spec`, holding of each of `keys` only `rows` (client indices along dim 0): the other rows
    become masked entries, neither sent nor averaged (an update's coverage, not a pruning)."""
    masks = dict(spec.masks)
    for key in keys:
        if key not in client_state:
            continue
        held = torch.zeros_like(client_state[key], dtype=torch.bool)
        held[rows] = True
        masks[key] = masks[key].to(held.device) & held if key in masks else held
    return replace(spec, masks=masks)


# -- spec builders ------------------------------------------------------------------------------
def full_spec() -> SubmodelSpec:
    return SubmodelSpec()


def width_spec(model: ScalableModel, width: float, offsets: Mapping[str, int] | None = None) -> SubmodelSpec:
    """Keep ceil(width * base) channels of every coupled group of `model` (whole runs of a group's
    `unit` channels: ceil(width * base / unit) attention heads).

    Without `offsets` each group keeps its first channels (HeteroFL, ScaleFL, NeFL); an offset per
    group name rolls the window by that many units (channels, or heads), wrapping around (FedRolex)."""
    indices: dict[str, dict[int, Tensor]] = {}
    for group in model.channel_groups():
        keep = group.kept(width)
        if keep > group.size:
            raise ValueError(f"width {width} needs {keep} channels of group {group.name}, the model has {group.size}")
        offset = (offsets or {}).get(group.name, 0)
        if keep == group.size and offset == 0:
            continue
        runs = (torch.arange(keep // group.unit) + offset) % (group.size // group.unit)
        idx = (runs[:, None] * group.unit + torch.arange(group.unit)).flatten()
        for key, dim in group.members:
            indices.setdefault(key, {})[dim] = idx
    return SubmodelSpec(width=width, indices=indices)


def block_keys(model: ScalableModel, blocks: Iterable[int]) -> frozenset[str]:
    """State keys of the given body blocks."""
    keys: set[str] = set()
    for i in blocks:
        keys.update(f"body.{i}.{k}" for k in model.body[i].state_dict())
    return frozenset(keys)


def dropped_keys(model: ScalableModel, blocks: Iterable[int]) -> frozenset[str]:
    """State keys a client lacks when it skips the given body blocks (a projection block keeps its shortcut)."""
    return frozenset(f"body.{i}.{k}" for i in blocks for k in model.dropped_block_keys(i))


def drop_blocks(spec: SubmodelSpec, model: ScalableModel, blocks: Iterable[int]) -> SubmodelSpec:
    """Add depth scaling to `spec`: the given body blocks are skipped and their tensors absent
    (a block that changes the feature shape keeps its shortcut's)."""
    blocks = frozenset(blocks)
    return replace(spec, dropped_blocks=spec.dropped_blocks | blocks, absent=spec.absent | dropped_keys(model, blocks))


def truncate(spec: SubmodelSpec, model: ScalableModel, depth: int) -> SubmodelSpec:
    """Keep the first `depth` body blocks and the exits among them; the rest (and the head, unless
    nothing is cut) is absent."""
    count = len(model.body)
    if not 1 <= depth <= count:
        raise ValueError(f"depth must be in 1..{count}, got {depth}")
    absent = set(block_keys(model, range(depth, count)))
    absent.update(f"exits.{b}.{k}" for b in model.exit_blocks if b >= depth for k in model.exits[str(b)].state_dict())
    if depth < count:
        absent.update(f"head.{k}" for k in model.head.state_dict())
    return replace(spec, depth=depth, absent=spec.absent | absent)


def freeze(spec: SubmodelSpec, keys: Iterable[str]) -> SubmodelSpec:
    """Mark tensors the client holds but does not train."""
    return replace(spec, frozen=spec.frozen | frozenset(keys))
