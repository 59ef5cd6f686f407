"""The clients' optimiser: SGD or Adam stepped by torch's own kernels, without `torch.optim.Optimizer`.

`torch.optim.SGD` and `torch.optim.Adam` import `torch._dynamo` the first time one is built or
stepped (their methods are wrapped in `torch._disable_dynamo`, and `step` graph-breaks), which costs
a process 1.5 CPU-seconds, about as much as `import torch` itself: every Ray actor, Tune trial and
`hfl run` paid it before its first client. `ClientOptimizer` calls the same functional kernels those
classes call (`torch.optim.sgd.sgd`, `torch.optim.adam.adam`, in their multi-tensor `foreach` form)
with the arguments and state those classes pass, so a step gives the same numbers bit for bit
(tested against both classes), and it has the parts of the optimiser interface that clients, methods
(FedMef sets a step's learning rate through `param_groups`), `torch.amp.GradScaler` and Lightning
(its `Optimizable` protocol) use.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam
from torch.optim.sgd import sgd

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
"""torch.optim.Adam's defaults, which clients train with."""


class ClientOptimizer:
    """SGD with momentum and weight decay (`kind` "sgd") or Adam with L2 weight decay ("adam") over
    one group of `params`, as `torch.optim.SGD(..., foreach=True)` and `torch.optim.Adam(...,
    foreach=True)` step them."""

    def __init__(self, params: Iterable[Tensor], kind: str, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        if kind not in ("sgd", "adam"):
            raise ValueError(f"kind={kind!r}: 'sgd' or 'adam'")
        self.kind = kind
        self.defaults: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
        if kind == "sgd":
            self.defaults["momentum"] = momentum
        else:
            self.defaults.update(betas=ADAM_BETAS, eps=ADAM_EPS)
        self.param_groups: list[dict[str, Any]] = [{"params": list(params), **self.defaults}]
        self.state: defaultdict[Tensor, dict[str, Tensor]] = defaultdict(dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step over the parameters that have gradients; `closure` (Lightning's: forward and
        backward) runs first, with gradients enabled."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if params:
                    (self._sgd if self.kind == "sgd" else self._adam)(group, params)
        return loss

    def _sgd(self, group: dict[str, Any], params: list[Tensor]) -> None:
        momentum = group["momentum"]
        buffers = [self.state[p].get("momentum_buffer") for p in params] if momentum != 0 else []
        sgd(params, [p.grad for p in params], buffers, weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
            dampening=0.0, nesterov=False, maximize=False, has_sparse_grad=False, foreach=True, fused=None)
        if momentum != 0:
            for p, buffer in zip(params, buffers, strict=True):  # the kernel creates the first step's buffers in the list
                self.state[p]["momentum_buffer"] = buffer

    def _adam(self, group: dict[str, Any], params: list[Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if not state:  # as torch.optim.Adam: the step count a CPU float32 scalar, the moments zeros like p
                state["step"] = torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
             [s["step"] for s in states], amsgrad=False, has_complex=any(torch.is_complex(p) for p in params), beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False, foreach=True, capturable=False,
             differentiable=False, fused=None, decoupled_weight_decay=False)

    def state_dict(self) -> dict[str, Any]:
        """Lightning's protocol asks for it; clients never save their optimiser (a fresh one per client-round)."""
        ids = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return {"state": {ids[p]: s for p, s in self.state.items()},
                "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [ids[p] for p in g["params"]]}
                                 for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        self.state = defaultdict(dict, {params[i]: dict(s) for i, s in state_dict["state"].items()})
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
