"""A client-round's expected simulated time before it trains: the deadline check and `hfl budget`."""

from __future__ import annotations

from hfl.accounting.cost import tensor_bytes
from hfl.methods.base import Method
from hfl.simulation.clock import ClientTime
from hfl.simulation.devices import Device
from hfl.types import ClientTask, StateDict


def expected_time(method: Method, task: ClientTask, global_state: StateDict, device: Device) -> ClientTime:
    """What `task` would take on `device` (started at 0): the bytes it receives and would send back
    and the FLOPs its training is counted at, as the client-round's metrics will record them (bytes
    up: the whole client model less frozen and pruned entries; a client that sends fewer rows back
    takes less)."""
    ctx = task.ctx
    down = tensor_bytes(method.client_state(global_state, task.spec), task.spec.masks)
    flops = method.training_cost(task, min(ctx.train.batch_size, ctx.num_samples)).train_flops_per_sample * ctx.num_samples * ctx.train.local_epochs
    return ClientTime(ctx.client_id, 0.0, *device.durations(down, flops, ctx.num_samples, ctx.train.local_epochs, method.upload_bytes(task.spec)))


def meets_deadline(method: Method, task: ClientTask, global_state: StateDict) -> bool:
    """Whether `task` ends within its client's time budget (`fl.deadline_plans`) on its device; True without one.
    A ladder already chose the largest level that does; this holds every other method to the deadline."""
    budget = task.ctx.budget
    if budget is None or budget.time is None:
        return True
    return expected_time(method, task, global_state, budget.time.device).finish <= budget.time.seconds
