import pytest

import hfl.accounting.accountant as accountant_module


@pytest.fixture
def fresh_process(monkeypatch):
    """(start, calls): `start()` empties this process's shared measurements, as a new process
    begins, and `calls` lists the models measured since."""
    calls = []
    measure = accountant_module.measure_training_cost

    def start():
        monkeypatch.setattr(accountant_module, "_shared_costs", {})
        calls.clear()

    monkeypatch.setattr(accountant_module, "measure_training_cost", lambda model, *a, **k: calls.append(model) or measure(model, *a, **k))
    start()
    return start, calls
