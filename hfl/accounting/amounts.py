"""Budget amounts as the config writes them, and one client's budget: parsed without the model.

Amounts are absolute (`256MB`, `1.5GiB`, `3e9`) or relative to the model (`width:1/6`: what training
the configured model at width 1/6 costs, resolved by `hfl.accounting.budgets` with the accountant).
The config checks amounts with this module alone, so it imports neither torch nor the accounting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol


class TimedDevice(Protocol):
    """What a time budget asks of a device (`hfl.simulation.devices.Device`): the clock's durations.
    A protocol, not an import, so that amounts (which the config reads) need not know the simulation."""

    def durations(self, bytes_down: float, flops: float, num_samples: int, local_epochs: int, bytes_up: float) -> tuple[float, float, float]: ...


SCENARIOS = {
    "fair": ("1/6", "1/3", "1/2", "1"),
    "lack": ("1/8", "1/6", "1/2", "1"),
    "surplus": ("1/6", "1/3", "1/2", "2"),
}
"""FeDepth (Experimental setups): width ratios r whose full-model training memory is a budget."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_AMOUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_width(text: str) -> float:
    """'1/6' or '0.1667' -> a positive float."""
    try:
        value = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"an amount whose width ratio is a number or fraction (not {text!r}), e.g. width:1/6") from None
    if value <= 0:
        raise ValueError(f"an amount whose width ratio is positive (not {text!r}), e.g. width:1/6")
    return value


def check_amount(text: str) -> None:
    """Raise ValueError unless `text` is a well-formed amount."""
    text = str(text)
    if text.startswith("width:"):
        parse_width(text[len("width:") :])
        return
    match = _AMOUNT.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"an amount such as 256MB, 1.5GiB, 3e9 or width:1/6 (not {text!r})")


@dataclass(frozen=True)
class ClientBudget:
    """One client's limits; None where the config sets none."""

    tier: str
    memory_bytes: int | None
    flops: int | None
    """FLOPs of one client-round (all local epochs)."""
    upload_bytes: int | None
    time: TimeBudget | None = None
    """The round's deadline on the client's device (`fl.deadline_plans`); None: time limits no sub-model."""


@dataclass(frozen=True)
class TimeBudget:
    """A deadline on one device: a client-round must end within `seconds` of its start (docs/time.md)."""

    seconds: float
    device: TimedDevice

    def admits(self, bytes_down: float, flops: float, num_samples: int, local_epochs: int, bytes_up: float) -> bool:
        """Whether a client-round of these counts ends in time on the device, timed as the clock times it."""
        return sum(self.device.durations(bytes_down, flops, num_samples, local_epochs, bytes_up)) <= self.seconds


def absolute_amount(text: str) -> int:
    """The number of bytes (or FLOPs) an absolute amount stands for."""
    check_amount(text)
    match = _AMOUNT.match(str(text))
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
