"""RayBackend on a GPU: each client is capped at its memory budget; one that exceeds it fails with
CUDA out of memory, is recorded, and the run goes on without it."""

import pytest
import torch

from hfl.loggers import read_metrics
from hfl.server import run_experiment
from tests.conftest import small_config

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ray = pytest.importorskip("ray", reason="GPU machines may lack Ray; the other gpu tests still run there")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_a_client_over_its_budget_fails_and_the_run_goes_on(tmp_path):
    # PreResNet-20 at batch 32 on 32x32 inputs needs about 50 MiB; client 0 gets 20 MB.
    config = small_config(
        data={"name": "synthetic", "partition": "iid"},
        model={"name": "preresnet20"},
        fl={"rounds": 2, "clients": 4, "fraction": 1.0, "batch_size": 32},
        budgets={"scenario": "per_client", "memory": ["20MB", "1GB", "1GB", "1GB"]},
        backend={"name": "ray", "device": "cuda", "actors_per_pool": 2},
    )
    summary = run_experiment(config, tmp_path)
    for record in read_metrics(tmp_path):
        failed = {f["id"]: f["reason"] for f in record["failed_clients"]}
        assert set(failed) == {0} and "OutOfMemoryError" in failed[0], failed
        trained = record["clients"]
        assert sorted(c["id"] for c in trained) == [1, 2, 3]
        assert all(c["measured_peak_bytes"] <= c["budget_bytes"] for c in trained)
    assert summary["failed_client_rounds"] == 2 and summary["final_accuracy"] is not None
