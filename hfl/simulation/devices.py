"""Every client's device: speed, bandwidths and when it is online, from the config's tiers or a trace.

hfl's trace format (docs/time.md), JSON:
    {"period": 86400, "devices": [{"id": 0, "speed": 2e9, "down": 1e6, "up": 5e5,
                                   "online": [[0, 3600], [7200, 86400]]}, ...]}
or CSV with a header `id,speed,down,up,online` (and optionally `seconds_per_sample` instead of
`speed`), `online` written `0-3600;7200-86400`. `speed` is FLOP/s, `down` and `up` bytes/s,
`seconds_per_sample` (instead of speed) the time one training sample takes; `online` lists the
intervals [start, end) in simulated seconds when the device can train (absent or empty: always);
with `period` > 0 the intervals repeat every `period` seconds. Optional `energy_per_flop` (J per
training FLOP) and `energy_per_byte` (J per byte down or up), numbers >= 0, give a device's energy.
"""

from __future__ import annotations

import csv
import io
import json
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hfl.accounting.amounts import ClientBudget, TimeBudget, absolute_amount
from hfl.config import ExperimentConfig
from hfl.errors import ConfigError
from hfl.seeding import BUDGET_STREAM, DEVICE_STREAM, derive_seed

SYNTHETIC_TRACE = Path(__file__).with_name("synthetic_trace.json")
"""The trace `devices.trace=synthetic` reads; `synthetic_trace()` writes it (its recipe)."""


@dataclass(frozen=True)
class Device:
    """One client's device."""

    speed: float | None
    """Training FLOP/s; None where `seconds_per_sample` gives the speed."""
    down: float
    """Download bytes per second."""
    up: float
    """Upload bytes per second."""
    seconds_per_sample: float | None = None
    """Seconds one training sample takes (one pass), as traces that time devices give it."""
    online: tuple[tuple[float, float], ...] = ()
    """Intervals [start, end) when the device is online, sorted; empty: always online."""
    period: float = 0.0
    """The intervals repeat every `period` seconds; 0: they do not (offline after the last)."""
    energy_per_flop: float | None = None
    """Joules one training FLOP takes; None: not known (no energy is recorded unless one of the two is)."""
    energy_per_byte: float | None = None
    """Joules one byte sent or received takes; None: not known."""

    def durations(self, bytes_down: float, flops: float, num_samples: int, local_epochs: int, bytes_up: float) -> tuple[float, float, float]:
        """Seconds of a client-round's download, training (`flops` in all, or its samples each epoch)
        and upload: the clock's one formula, for the client-rounds run and those planned (`fl.deadline_plans`)."""
        compute = flops / self.speed if self.speed is not None else self.seconds_per_sample * num_samples * local_epochs
        return bytes_down / self.down, compute, bytes_up / self.up

    def energy(self, flops: float, bytes_moved: float) -> float | None:
        """Joules of a client-round's training and communication; None where the device has no energy figures."""
        if self.energy_per_flop is None and self.energy_per_byte is None:
            return None
        return flops * (self.energy_per_flop or 0.0) + bytes_moved * (self.energy_per_byte or 0.0)

    def online_until(self, t: float) -> float | None:
        """The end of the online stretch holding time `t` (inf: it never ends); None when offline at `t`."""
        if not self.online:
            return math.inf
        base, local = (t - t % self.period, t % self.period) if self.period else (0.0, t)
        for start, end in self.online:
            if start <= local < end:
                if self.period and end >= self.period and self.online[0][0] == 0 and base + end > t:
                    if self.online[0][1] >= self.period:  # online the whole period: the stretch never ends
                        return math.inf
                    following = self.online_until(base + self.period)  # the stretch goes on into the next period
                    return following if following is not None else base + end
                return base + end
        return None

    def next_online(self, t: float) -> float | None:
        """The earliest time >= t when the device is online; None if never again."""
        if self.online_until(t) is not None:
            return t
        base, local = (t - t % self.period, t % self.period) if self.period else (0.0, t)
        later = [start for start, _ in self.online if start > local]
        if later:
            return base + later[0]
        return base + self.period + self.online[0][0] if self.period else None


def _number(value: Any, field: str, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(field, value, f"a number ({where})") from None
    if not (math.isfinite(number) and number > 0):
        raise ConfigError(field, value, f"a positive number ({where})")
    return number


def _energy(value: Any, field: str, where: str) -> float | None:
    """An optional energy figure: None where absent (or an empty CSV cell), else a number >= 0."""
    if value in (None, ""):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(field, value, f"a number of joules >= 0 ({where})") from None
    if not (math.isfinite(number) and number >= 0):
        raise ConfigError(field, value, f"a number of joules >= 0 ({where})")
    return number


def _intervals(value: Any, field: str, where: str) -> tuple[tuple[float, float], ...]:
    if value in (None, "", []):
        return ()
    if isinstance(value, str):
        value = [part.split("-") for part in value.split(";") if part.strip()]
    try:
        pairs = tuple((float(a), float(b)) for a, b in value)
    except (TypeError, ValueError):
        raise ConfigError(field, value, f"intervals [start, end) of simulated seconds, e.g. [[0, 3600]] or 0-3600;7200-9000 ({where})") from None
    ok = all(0 <= a < b for a, b in pairs) and all(pairs[i][1] <= pairs[i + 1][0] for i in range(len(pairs) - 1))
    if not ok:
        raise ConfigError(field, value, f"sorted, disjoint intervals [start, end) with 0 <= start < end ({where})")
    return pairs


def read_trace(path: str | Path) -> dict[int, Device]:
    """The devices of a trace file in hfl's format, by id; a ConfigError naming the entry where one is malformed."""
    path = Path(path)
    field = "devices.trace"
    if not path.is_file():
        raise ConfigError(field, str(path), "a JSON or CSV device trace (docs/time.md) or synthetic: no such file")
    period = 0.0
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        rows = data.get("devices") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise ConfigError(field, str(path), 'a JSON object with a list "devices" (docs/time.md)')
        period = float(data.get("period", 0.0))
    elif path.suffix == ".csv":
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        raise ConfigError(field, str(path), "a .json or .csv device trace (docs/time.md) or synthetic")
    devices: dict[int, Device] = {}
    for i, row in enumerate(rows):
        where = f"{path.name}, device {i}"
        try:
            id_ = int(row["id"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{field} id", row.get("id") if isinstance(row, dict) else row, f"an integer id >= 0 ({where})") from None
        where = f"{path.name}, device id {id_}"
        if id_ < 0 or id_ in devices:
            raise ConfigError(f"{field} id", id_, f"distinct integer ids >= 0 ({where})")
        per_sample = row.get("seconds_per_sample") or None
        speed = row.get("speed") or None
        if (speed is None) == (per_sample is None):
            raise ConfigError(f"{field} speed", speed, f"exactly one of speed (FLOP/s) and seconds_per_sample ({where})")
        devices[id_] = Device(
            _number(speed, f"{field} speed", where) if speed is not None else None,
            _number(row.get("down"), f"{field} down", where),
            _number(row.get("up"), f"{field} up", where),
            _number(per_sample, f"{field} seconds_per_sample", where) if per_sample is not None else None,
            _intervals(row.get("online"), f"{field} online", where),
            period,
            _energy(row.get("energy_per_flop"), f"{field} energy_per_flop", where),
            _energy(row.get("energy_per_byte"), f"{field} energy_per_byte", where),
        )
    if not devices:
        raise ConfigError(field, str(path), "a trace with at least one device")
    if period and any(end > period for d in devices.values() for _, end in d.online):
        raise ConfigError(f"{field} period", period, f"at least every online interval's end ({path.name})")
    return devices


def trace_devices(config: ExperimentConfig) -> list[Device]:
    """Every client's device from the trace `devices.trace` (hfl's or FedScale's), mapped as `devices.mapping` says
    (FedScale's client ids are renumbered 0..D-1 in their order)."""
    spec = config.devices
    synthetic = spec.trace == "synthetic"
    if spec.source == "fedscale":
        devices = read_fedscale(spec.trace, spec.behaviour or None)
    else:
        devices = read_trace(SYNTHETIC_TRACE if synthetic else spec.trace)
    clients = config.fl.clients
    mapping = spec.mapping if spec.mapping != "auto" else ("cycle" if synthetic or spec.source == "fedscale" else "by_id")
    if mapping == "cycle":
        ordered = [devices[i] for i in sorted(devices)]
        return [ordered[c % len(ordered)] for c in range(clients)]
    unknown = sorted(i for i in devices if i >= clients)
    if unknown:
        raise ConfigError("devices.trace", spec.trace, f"device ids that are client ids 0..{clients - 1} under devices.mapping=by_id "
                          f"(it lists {unknown[:5]}; devices.mapping=cycle hands its devices to the clients in turn)")
    missing = [c for c in range(clients) if c not in devices]
    if missing:
        raise ConfigError("devices.trace", spec.trace, f"a device for every client 0..{clients - 1} under devices.mapping=by_id "
                          f"(it lacks {missing[:5]}; devices.mapping=cycle hands its devices to the clients in turn)")
    return [devices[c] for c in range(clients)]


FEDSCALE_TRAINING_FACTOR = 3.0
"""FedScale's capacity trace gives inference milliseconds per sample; a training step (forward and
backward) counts as 3 of them, as FedScale's simulator does."""
FEDSCALE_KBIT = 1024 / 8
"""Bytes per second in one kbit/s of FedScale's `communication` (its sizes are kbit of 1024 bits)."""


class _PlainUnpickler(pickle.Unpickler):
    """Loads dicts, lists, numbers and strings only: a trace is data, and a pickle naming any class
    could run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_pickle(path: str | Path, field: str, allowed: str) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(field, str(path), f"{allowed}: no such file")
    try:
        return _PlainUnpickler(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as error:
        raise ConfigError(field, str(path), f"{allowed} holding only dicts, lists, numbers and strings ({error})") from None


def read_fedscale(capacity: str | Path, behaviour: str | Path | None = None) -> dict[int, Device]:
    """Devices from FedScale's traces (docs/time.md): the device-capacity pickle {client id:
    {"computation": inference ms per sample, "communication": kbit/s}} and, optionally, the behaviour
    pickle {client id: {"active": [starts], "inactive": [ends], "finish_time": period, ...}}."""
    allowed = "FedScale's client_device_capacity pickle: {client id: {'computation': ms, 'communication': kbit/s}}"
    entries = read_pickle(capacity, "devices.trace", allowed)
    if not isinstance(entries, dict) or not entries:
        raise ConfigError("devices.trace", str(capacity), allowed)
    traces: dict[Any, Any] = {}
    behaviour_allowed = "FedScale's client_behave_trace pickle: {client id: {'active': [...], 'inactive': [...], 'finish_time': s}}"
    if behaviour:
        traces = read_pickle(behaviour, "devices.behaviour", behaviour_allowed)
        if not isinstance(traces, dict) or not traces:
            raise ConfigError("devices.behaviour", str(behaviour), behaviour_allowed)
    devices: dict[int, Device] = {}
    for i, (key, entry) in enumerate(sorted(entries.items())):
        where = f"{Path(capacity).name}, client {key}"
        if not isinstance(entry, dict):
            raise ConfigError("devices.trace", entry, f"{{'computation': ms, 'communication': kbit/s}} ({where})")
        per_sample = _number(entry.get("computation"), "devices.trace computation", where) * FEDSCALE_TRAINING_FACTOR / 1000
        bandwidth = _number(entry.get("communication"), "devices.trace communication", where) * FEDSCALE_KBIT
        online: tuple[tuple[float, float], ...] = ()
        period = 0.0
        if traces:  # FedScale pairs the i-th capacity with the i-th behaviour trace, in turn
            trace = traces[sorted(traces)[i % len(traces)]]
            where = f"{Path(behaviour).name}, client {sorted(traces)[i % len(traces)]}"
            try:
                pairs = [[float(a), float(b)] for a, b in zip(trace["active"], trace["inactive"], strict=True) if float(b) > float(a)]
                period = _number(trace["finish_time"], "devices.behaviour finish_time", where)
            except (KeyError, TypeError, ValueError):
                raise ConfigError("devices.behaviour", str(behaviour), f"{behaviour_allowed} ({where})") from None
            online = _intervals(pairs, "devices.behaviour active", where)
        devices[i] = Device(None, bandwidth, bandwidth, per_sample, online, period)
    return devices


def client_tiers(config: ExperimentConfig) -> list[int]:
    """Every client's budget tier index, as `hfl.accounting.budgets` assigns them (0 without budgets)."""
    if not config.budgets.enabled:
        return [0] * config.fl.clients
    from hfl.accounting.budgets import plan_tiers

    rng = np.random.default_rng(derive_seed(config.seed, BUDGET_STREAM))
    return plan_tiers(config.budgets, config.fl.clients, rng)[1]


def tier_devices(config: ExperimentConfig) -> list[Device]:
    """Every client's device from the tier entries `devices.speed`, `down`, `up` (and energy figures)."""
    spec = config.devices
    per_flop = spec.energy_per_flop or (None,) * len(spec.speed)
    per_byte = spec.energy_per_byte or (None,) * len(spec.speed)
    classes = [Device(float(absolute_amount(s)), float(absolute_amount(d)), float(absolute_amount(u)), energy_per_flop=f, energy_per_byte=b)
               for s, d, u, f, b in zip(spec.speed, spec.down, spec.up, per_flop, per_byte)]
    return [classes[t] for t in client_tiers(config)]


def spread_devices(devices: Sequence[Device], sigma: float, seed: int) -> list[Device]:
    """Each device's speed times exp(sigma z1) and bandwidths times exp(sigma z2), z ~ N(0, 1) per client."""
    if sigma == 0:
        return list(devices)
    z = np.random.default_rng(derive_seed(seed, DEVICE_STREAM)).standard_normal((len(devices), 2))
    spread = []
    for d, (zs, zb) in zip(devices, z):
        fs, fb = math.exp(sigma * zs), math.exp(sigma * zb)
        spread.append(replace(d, speed=d.speed * fs if d.speed else None, down=d.down * fb, up=d.up * fb,
                              seconds_per_sample=d.seconds_per_sample / fs if d.seconds_per_sample else None))
    return spread


def assign_devices(config: ExperimentConfig) -> list[Device] | None:
    """Every client's device (seeded, fixed for the run); None without `devices`."""
    spec = config.devices
    if not spec.enabled:
        return None
    if spec.source == "tiers":
        devices = tier_devices(config)
    else:  # the config's one energy figure stands in for those the trace does not give
        devices = [replace(d, energy_per_flop=d.energy_per_flop if d.energy_per_flop is not None else (spec.energy_per_flop or (None,))[0],
                           energy_per_byte=d.energy_per_byte if d.energy_per_byte is not None else (spec.energy_per_byte or (None,))[0])
                   for d in trace_devices(config)]
    return spread_devices(devices, spec.spread, config.seed)


DEADLINE_TIER = "all"
"""The tier of the time budgets `fl.deadline_plans` gives clients without other budgets."""


def deadline_budgets(config: ExperimentConfig, budgets: Sequence[ClientBudget | None]) -> list[ClientBudget | None]:
    """Every client's budget with, under `fl.deadline_plans`, the round's deadline on its device as a
    time budget (a client without budgets gets one of time alone, tier `all`); unchanged otherwise."""
    if not config.fl.deadline_plans:
        return list(budgets)
    time = [TimeBudget(config.fl.deadline_s, device) for device in assign_devices(config)]
    return [replace(b, time=t) if b is not None else ClientBudget(DEADLINE_TIER, None, None, None, t) for b, t in zip(budgets, time)]


def synthetic_trace(count: int = 100, seed: int = 48, period: float = 86400.0) -> dict[str, Any]:
    """The recipe of hfl's shipped trace (`devices.trace=synthetic`): `count` devices in three classes
    (shares 0.5 / 0.3 / 0.2) of median speed 1e9 / 4e9 / 1.6e10 FLOP/s, download 1e6 / 4e6 / 1.6e7 and
    upload 2.5e5 / 1e6 / 4e6 bytes/s, each multiplied per device by log-normal factors of sigma 0.3
    (one for speed, one for both bandwidths); over a day (`period`), each device alternates online and
    offline stretches drawn exponentially with means 4 h and 2 h, starting online with probability
    2/3 (so about two thirds of the devices are online at any time). Values rounded to 4 digits."""
    rng = np.random.default_rng(seed)
    classes = [(1e9, 1e6, 2.5e5), (4e9, 4e6, 1e6), (1.6e10, 1.6e7, 4e6)]
    kinds = rng.choice(3, size=count, p=[0.5, 0.3, 0.2])
    devices = []
    for i, kind in enumerate(kinds):
        speed, down, up = classes[kind]
        fs, fb = np.exp(0.3 * rng.standard_normal(2))
        online, t, on = [], 0.0, rng.random() < 2 / 3
        while t < period:
            length = float(rng.exponential(4 * 3600 if on else 2 * 3600))
            end = min(t + length, period)
            if on and end > t:
                online.append([round(t, 1), round(end, 1)])
            t, on = end, not on
        devices.append({"id": i, "speed": float(f"{speed * fs:.4g}"), "down": float(f"{down * fb:.4g}"),
                        "up": float(f"{up * fb:.4g}"), "online": online})
    return {"period": period, "recipe": "hfl.simulation.devices.synthetic_trace(count=100, seed=48, period=86400)", "devices": devices}
