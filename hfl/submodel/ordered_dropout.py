"""Ordered dropout (FjORD, Horváth et al., NeurIPS 2021): a model computes its width-p prefix network
in place, through forward hooks that keep the first channels of every coupled channel group and
zero the rest, with the batch-norm copy of that width; nothing is copied or rebuilt per width."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from hfl.models.base import ChannelGroup, ScalableModel
from hfl.submodel.copies import NormCopies

FEATURES_LAST = (nn.Linear, nn.LayerNorm, nn.Embedding)
"""Layers whose outputs hold their channels last: inside a transformer block (batch, tokens, dim).
Convolutions and batch norms hold them at dim 1 (on 2-D outputs the two are the same)."""


def _zero_beyond(keep: int, dim: int = 1) -> Callable[[nn.Module, Any, Tensor], Tensor]:
    """A forward hook that zeroes a layer's output channels `keep`.. (along `dim`). Padding a slice
    saves nothing for backward (a multiplied mask would), so the masked forward costs what the plain one does."""

    def hook(_module: nn.Module, _inputs: Any, out: Tensor) -> Tensor:
        d = dim % out.dim()
        return F.pad(out.narrow(d, 0, keep), [0, 0] * (out.dim() - 1 - d) + [0, out.shape[d] - keep])

    return hook


def _narrow_layer_norm(keep: int) -> Callable[[nn.Module, Any, Tensor], Tensor]:
    """A forward hook that recomputes a LayerNorm over its first `keep` channels only, zero beyond:
    what the narrow network's LayerNorm computes (zeroing the full norm's output would leave the
    statistics of the dropped channels in the kept ones, unlike a batch norm's per-channel ones)."""

    def hook(module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> Tensor:
        x = inputs[0].narrow(-1, 0, keep)
        weight = None if module.weight is None else module.weight[:keep]
        bias = None if module.bias is None else module.bias[:keep]
        return F.pad(F.layer_norm(x, (keep,), weight, bias, module.eps), [0, out.shape[-1] - keep])

    return hook


def output_layers(model: ScalableModel) -> list[tuple[nn.Module, ChannelGroup]]:
    """Every layer whose outputs (dim 0 of its state) index a channel group, with that group; a set
    of norm copies stands for its copies."""
    modules = dict(model.named_modules())
    owner = {f"{name}.{copy}": name for name, m in modules.items() if isinstance(m, NormCopies) for copy in m.names()}
    layers: dict[str, tuple[nn.Module, ChannelGroup]] = {}
    for group in model.channel_groups():
        for key, dim in group.members:
            name = key.rpartition(".")[0]
            name = owner.get(name, name)
            if dim == 0 and name not in layers:
                layers[name] = (modules[name], group)
    return list(layers.values())


@contextmanager
def ordered_dropout(model: ScalableModel, width: float, norm: str | None, layers: list[tuple[nn.Module, ChannelGroup]]) -> Iterator[None]:
    """While active, `model` computes the width-`width` prefix network (absolute width ratio) with
    the batch-norm copy `norm` (None: no copies); the model's own width needs no masks."""
    norms = [layer for layer, _ in layers if isinstance(layer, NormCopies)]
    previous = [n.active for n in norms]
    # An attention whose score scale follows its head dimension (the ViT's) scales as the narrow one does.
    group_of = {id(layer): group for layer, group in layers}
    attentions = [m for m in model.modules() if hasattr(m, "scale_at") and id(m.q) in group_of]
    scales = [m.scale for m in attentions]
    hooks = []
    try:
        for copies in norms:
            copies.active = norm
        for attention in attentions:
            attention.scale = attention.scale_at(group_of[id(attention.q)].kept(width))
        for layer, group in layers:
            keep = group.kept(width)
            if keep > group.size:
                raise ValueError(f"width {width:g} needs {keep} channels of group {group.name}, the model has {group.size}")
            if keep < group.size:
                if isinstance(layer, nn.LayerNorm):
                    hook = _narrow_layer_norm(keep)
                else:
                    hook = _zero_beyond(keep, getattr(layer, "channel_dim", -1 if isinstance(layer, FEATURES_LAST) else 1))
                hooks.append(layer.register_forward_hook(hook))
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for copies, active in zip(norms, previous):
            copies.active = active
        for attention, scale in zip(attentions, scales):
            attention.scale = scale
