"""Every registered method under the deadline policy (a straggler dropped every round) and under
async (FedBuff) or its one-line refusal: the contract runs of tests/methods/test_registry_contract.py
with devices."""

import dataclasses

import pytest

from hfl.errors import ConfigError
from hfl.methods.base import Method
from hfl.registry import METHODS
from hfl.server import run_experiment
from tests.methods.test_registry_contract import CONTRACT_RUNS, fair_config

def devices(config, speeds):
    """A device per budget tier of `config` (the fair budgets' four, or a method's own), at `speeds`
    FLOP/s in order (the last repeated) and all but instant bandwidths."""
    from hfl.config import DevicesConfig, budget_tier_count

    tiers = budget_tier_count(config.budgets)
    speed = [*speeds, *[speeds[-1]] * tiers][:tiers]
    return DevicesConfig(source="tiers", speed=tuple(speed), down=("1e12",) * tiers, up=("1e12",) * tiers)
REFUSES_ASYNC = {"caff", "feddf", "feddst", "fedhm", "fedmef", "fedtiny"}
"""Methods whose server step is not the masked weighted mean (mask adjustments, distillation,
factors, CAFF's averaging): async would apply a stale server step."""


def with_devices(config, speeds, **fl):
    return dataclasses.replace(config, devices=devices(config, speeds), fl=dataclasses.replace(config.fl, **fl))


@pytest.mark.slow
@pytest.mark.parametrize(("method", "model"), CONTRACT_RUNS)
def test_every_method_runs_under_a_deadline_dropping_a_straggler(tmp_path, method, model):
    import json

    from hfl.config import DevicesConfig
    from hfl.loggers import read_metrics

    # client 0's device runs 1 FLOP/s: a straggler under any deadline the others (1e12 FLOP/s) meet
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"devices": [{"id": c, "speed": 1 if c == 0 else 1e12, "down": 1e12, "up": 1e12} for c in range(4)]}))
    config = fair_config(method, rounds=1, model=model, tmp_path=tmp_path)
    config = dataclasses.replace(config, devices=DevicesConfig(source="trace", trace=str(trace)),
                                 fl=dataclasses.replace(config.fl, round_policy="deadline", deadline_s=1e4))
    run_experiment(config, tmp_path / "run")
    (record,) = read_metrics(tmp_path / "run")
    assert record["stragglers"] == [c["id"] for c in record["clients"] if c["id"] == 0]
    assert all(c.get("dropped") == ("deadline" if c["id"] == 0 else None) for c in record["clients"])


@pytest.mark.slow
@pytest.mark.parametrize(("method", "model"), CONTRACT_RUNS)
def test_every_method_runs_async_or_refuses_it_naming_method_and_policy(tmp_path, method, model):
    from hfl.loggers import read_metrics

    # all four clients train at once from version 0; the first two to arrive make step 1, and restart from version 1
    config = with_devices(fair_config(method, model=model, tmp_path=tmp_path), ["1e9"], round_policy="async", async_concurrency=4, async_buffer=2)
    assert (METHODS.get(method).aggregate is not Method.aggregate) == (method in REFUSES_ASYNC)
    if method in REFUSES_ASYNC:
        with pytest.raises(ConfigError, match=f"method {method}: its server step"):
            run_experiment(config, tmp_path / "run")
        return
    run_experiment(config, tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    assert records[0]["staleness"] == [0, 0]
    for step, record in enumerate(records):
        assert record["staleness"] == [step - c["version"] for c in record["clients"]]
