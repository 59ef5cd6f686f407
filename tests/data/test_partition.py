"""Client partitions: disjointness, sizes, label skew, determinism, and bad requests."""

from __future__ import annotations

import numpy as np
import pytest

from hfl.data import label_histogram, partition, save_label_heatmap
from hfl.errors import ConfigError
from hfl.registry import PARTITIONERS


@pytest.fixture(scope="module")
def digits_labels() -> np.ndarray:
    from sklearn.datasets import load_digits

    return load_digits().target.astype(np.int64)


def synthetic_labels(n: int = 3000, num_classes: int = 10, seed: int = 0, skew: bool = False) -> np.ndarray:
    """Shuffled labels; with skew, class c holds a share proportional to c + 1."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_classes + 1) if skew else np.ones(num_classes)
    counts = np.floor(weights / weights.sum() * n).astype(int)
    counts[0] += n - counts.sum()
    return rng.permutation(np.repeat(np.arange(num_classes), counts))


SCHEMES = [
    ("iid", {}),
    ("dirichlet", {"alpha": 0.3}),
    ("dirichlet_unbalanced", {"alpha": 0.3}),
    ("pathological", {"labels_per_client": 2}),
]


def assert_disjoint(parts: list[np.ndarray], n: int) -> np.ndarray:
    union = np.concatenate(parts)
    assert union.dtype == np.int64
    assert np.unique(union).size == union.size, "an index is given to two clients"
    assert union.min() >= 0 and union.max() < n
    return union


def test_registry_holds_every_scheme() -> None:
    assert PARTITIONERS.names() == ["dirichlet", "dirichlet_unbalanced", "iid", "pathological"]


@pytest.mark.parametrize("name,options", SCHEMES)
@pytest.mark.parametrize("source", ["digits", "synthetic", "skewed"])
def test_every_index_at_most_once_and_documented_sizes(name: str, options: dict, source: str, digits_labels: np.ndarray) -> None:
    labels = {"digits": digits_labels, "synthetic": synthetic_labels(), "skewed": synthetic_labels(skew=True)}[source]
    n, k = labels.size, 20
    parts = partition(name, labels, k, seed=1, **options)

    union = assert_disjoint(parts, n)
    assert len(parts) == k
    assert all(p.size > 0 for p in parts)
    assert all(np.all(np.diff(p) > 0) for p in parts), "each client's indices come sorted"
    if name in ("iid", "dirichlet"):
        # Documented: exactly floor(N / K) each, the remainder dropped.
        assert {p.size for p in parts} == {n // k}
        assert union.size == (n // k) * k
    else:
        # Documented: every sample is assigned (every label is held when K * Lambda >= C).
        assert union.size == n


def test_dirichlet_is_balanced_and_unbalanced_is_not() -> None:
    labels = synthetic_labels(n=5000)
    balanced = partition("dirichlet", labels, 30, seed=0, alpha=0.1)
    unbalanced = partition("dirichlet_unbalanced", labels, 30, seed=0, alpha=0.1)
    assert len({p.size for p in balanced}) == 1
    assert len({p.size for p in unbalanced}) > 1


def mean_max_share(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    hist = label_histogram(labels, parts, int(labels.max()) + 1)
    return float((hist.max(axis=1) / hist.sum(axis=1)).mean())


@pytest.mark.parametrize("name", ["dirichlet", "dirichlet_unbalanced"])
def test_small_alpha_is_more_skewed_than_large_alpha(name: str, digits_labels: np.ndarray) -> None:
    skewed = mean_max_share(digits_labels, partition(name, digits_labels, 20, seed=3, alpha=0.1))
    mild = mean_max_share(digits_labels, partition(name, digits_labels, 20, seed=3, alpha=100.0))
    assert skewed > 0.5
    assert mild < 0.25
    assert skewed > mild + 0.3


@pytest.mark.parametrize("lam", [1, 2, 5, 10])
def test_pathological_gives_exactly_lambda_labels(lam: int, digits_labels: np.ndarray) -> None:
    k = 30
    parts = partition("pathological", digits_labels, k, seed=4, labels_per_client=lam)
    hist = label_histogram(digits_labels, parts, 10)
    assert np.all((hist > 0).sum(axis=1) == lam)
    # Each label is held by floor(K * Lambda / C) or one more clients.
    holders = (hist > 0).sum(axis=0)
    assert holders.sum() == k * lam
    assert holders.max() - holders.min() <= 1
    # A label's samples are split equally among its holders.
    for c in range(10):
        shares = hist[hist[:, c] > 0, c]
        assert shares.max() - shares.min() <= 1


def test_pathological_with_fewer_slots_than_classes_leaves_labels_out() -> None:
    labels = synthetic_labels(n=1000)
    parts = partition("pathological", labels, 2, seed=0, labels_per_client=2)
    hist = label_histogram(labels, parts, 10)
    assert np.all((hist > 0).sum(axis=1) == 2)
    assert ((hist > 0).sum(axis=0) > 0).sum() == 4


def test_unbalanced_gives_every_client_a_sample() -> None:
    # Tiny alpha with many clients leaves some clients empty before the repair step.
    labels = synthetic_labels(n=200)
    for seed in range(5):
        parts = partition("dirichlet_unbalanced", labels, 60, seed=seed, alpha=0.01)
        assert min(p.size for p in parts) >= 1
        assert_disjoint(parts, labels.size)


@pytest.mark.parametrize("name,options", SCHEMES)
def test_same_seed_same_partition_other_seed_differs(name: str, options: dict, digits_labels: np.ndarray) -> None:
    a = partition(name, digits_labels, 10, seed=7, **options)
    b = partition(name, digits_labels, 10, seed=7, **options)
    c = partition(name, digits_labels, 10, seed=8, **options)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_partitioners_ignore_options_meant_for_others(digits_labels: np.ndarray) -> None:
    rng = np.random.default_rng(0)
    parts = PARTITIONERS.get("iid")(digits_labels, 5, rng, alpha=0.1, labels_per_client=3)
    assert len(parts) == 5


@pytest.mark.parametrize(
    "name,labels,num_clients,options,match",
    [
        ("iid", np.arange(5), 6, {}, "more than the 5 samples"),
        ("dirichlet", np.arange(5), 6, {"alpha": 0.5}, "more than the 5 samples"),
        ("iid", np.arange(5), 0, {}, "positive integer"),
        ("dirichlet", np.zeros(10, dtype=int), 2, {"alpha": 0.0}, "alpha"),
        ("dirichlet_unbalanced", np.zeros(10, dtype=int), 2, {"alpha": -1.0}, "alpha"),
        ("dirichlet", np.zeros(10, dtype=int), 2, {"alpha": float("nan")}, "alpha"),
        ("pathological", np.arange(10) % 3, 2, {"labels_per_client": 4}, "more than the 3 classes"),
        ("pathological", np.arange(10) % 3, 2, {"labels_per_client": 0}, "positive integer"),
        ("pathological", np.arange(12) % 3, 12, {"labels_per_client": 2}, "must be shared by"),
        ("iid", np.array([], dtype=int), 1, {}, "non-empty"),
        ("iid", np.linspace(0, 1, 10), 2, {}, "integers"),
    ],
)
def test_impossible_requests_raise_value_error(name: str, labels: np.ndarray, num_clients: int, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition(name, labels, num_clients, seed=0, **options)


def test_unknown_scheme_names_the_config_field() -> None:
    with pytest.raises(ConfigError, match="data.partition"):
        partition("shards", np.arange(10), 2, seed=0)


def test_label_histogram_counts() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2, 0])
    parts = [np.array([0, 1, 2]), np.array([3, 4]), np.array([5, 6])]
    expected = np.array([[1, 2, 0], [0, 0, 2], [1, 0, 1]])
    np.testing.assert_array_equal(label_histogram(labels, parts, 3), expected)
    np.testing.assert_array_equal(label_histogram(labels, parts, 4)[:, 3], 0)
    with pytest.raises(ValueError, match="outside"):
        label_histogram(labels, parts, 2)


def test_save_label_heatmap_writes_png(tmp_path, digits_labels: np.ndarray) -> None:
    parts = partition("dirichlet", digits_labels, 12, seed=0, alpha=0.3)
    path = tmp_path / "plots" / "labels.png"
    save_label_heatmap(label_histogram(digits_labels, parts, 10), str(path), title="dirichlet(0.3)")
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
