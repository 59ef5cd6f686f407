"""Split a training set's sample indices among clients: IID, Dirichlet (balanced or not), pathological.

The non-IID schemes follow the FeDepth paper's "Datasets and data partition" section:
`dirichlet` is its default balanced alpha(lambda) split (every client holds the same number of
samples, label proportions drawn from Dir(alpha), as in Acar et al. 2021 / FedDyn),
`dirichlet_unbalanced` its alpha_u(lambda) split (each class split over clients by Dir(alpha), as
in Hsu et al. 2019 / Yurochkin et al. 2019), and `pathological` its beta(Lambda) split (Lambda
distinct labels per client, as in HeteroFL / SplitMix).

Every partitioner takes `(labels, num_clients, rng, **options)` and returns one sorted int64 index
array per client; no index appears twice. All randomness comes from `rng`.

A dataset that comes with its own clients (Shakespeare's roles, `hfl.data.NATURAL_CLIENTS`)
is not split by labels: it takes `data.partition=natural`, which no partitioner implements.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import numpy as np

from hfl.registry import PARTITIONERS

logger = logging.getLogger(__name__)

def partition(
    name: str,
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    alpha: float = 0.5,
    labels_per_client: int = 2,
) -> list[np.ndarray]:
    """Partition `labels`' indices among `num_clients` with the partitioner registered as `name`.

    Every partitioner receives both `alpha` and `labels_per_client` and ignores the one it has
    no use for, so config code need not know which scheme wants which option.
    """
    fn = PARTITIONERS.get(name, field="data.partition")
    rng = np.random.default_rng(seed)
    return fn(labels, num_clients, rng, alpha=alpha, labels_per_client=labels_per_client)


def _check(labels: np.ndarray, num_clients: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise ValueError(f"labels must be a non-empty 1-D array, got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ValueError(f"num_clients={num_clients!r}: must be a positive integer")
    if num_clients > labels.size:
        raise ValueError(f"num_clients={num_clients} is more than the {labels.size} samples to split")
    return labels


def _check_alpha(alpha: float) -> float:
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha={alpha!r}: the Dirichlet concentration must be a positive finite number")
    return float(alpha)


def _finish(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


@PARTITIONERS.register("iid")
def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator, **options: Any) -> list[np.ndarray]:
    """Shuffle and give every client floor(N / K) samples; the N mod K left over are dropped.

    Dropping the remainder (at most K - 1 samples) keeps clients exactly equal, as `dirichlet` does.
    """
    labels = _check(labels, num_clients)
    quota = labels.size // num_clients
    perm = rng.permutation(labels.size)[: quota * num_clients]
    return _finish(list(perm.reshape(num_clients, quota)))


@PARTITIONERS.register("dirichlet")
def dirichlet(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, alpha: float, **options: Any
) -> list[np.ndarray]:
    """Balanced Dirichlet split: every client gets exactly floor(N / K) samples, the N mod K left over are dropped.

    Client k draws label proportions p_k ~ Dir(alpha * 1). Samples are then handed out one at a
    time in a random interleaving of the clients (so no client is systematically last to pick):
    the receiving client draws a label from p_k restricted to the labels that still have
    unassigned samples (p_k renormalised; uniform over those labels by remaining count if p_k has
    no mass left on them) and takes a random unassigned sample of that label.
    Small alpha gives each client few labels, large alpha approaches IID.
    """
    labels = _check(labels, num_clients)
    alpha = _check_alpha(alpha)
    classes, y = np.unique(labels, return_inverse=True)
    num_classes = classes.size
    quota = labels.size // num_clients
    remaining = np.bincount(y, minlength=num_classes)
    priors = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
    priors = np.nan_to_num(priors, nan=0.0)

    # The order in which clients receive samples, one entry per sample handed out.
    order = rng.permutation(np.repeat(np.arange(num_clients), quota))
    drawn = np.empty(order.size, dtype=np.int64)
    start = 0
    # Between two moments where a label runs out, draws are independent given the masked priors,
    # so the rest of the sequence is drawn at once and cut where the first label overflows.
    # This loops at most once per label instead of once per sample.
    while start < order.size:
        avail = remaining > 0
        probs = priors * avail
        mass = probs.sum(axis=1, keepdims=True)
        fallback = remaining / remaining.sum()
        probs = np.where(mass > 0, probs / np.where(mass > 0, mass, 1.0), fallback)
        clients = order[start:]
        cls = _sample_rows(probs, clients, rng.random(clients.size), avail)
        # Position in `cls` of the (remaining[c] + 1)-th draw of each label c, if any.
        by_label = np.argsort(cls, kind="stable")
        counts = np.bincount(cls, minlength=num_classes)
        firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        over = np.flatnonzero(counts > remaining)
        stop = clients.size if over.size == 0 else int(by_label[firsts[over] + remaining[over]].min())
        drawn[start : start + stop] = cls[:stop]
        remaining -= np.bincount(cls[:stop], minlength=num_classes)
        start += stop

    # Hand out each label's samples in a random order, in the order the label was drawn.
    owner = np.empty(order.size, dtype=np.int64)
    sample = np.empty(order.size, dtype=np.int64)
    steps_by_label = np.argsort(drawn, kind="stable")
    counts = np.bincount(drawn, minlength=num_classes)
    pos = 0
    for c in range(num_classes):
        steps = steps_by_label[pos : pos + counts[c]]
        pool = rng.permutation(np.flatnonzero(y == c))[: counts[c]]
        owner[pos : pos + counts[c]] = order[steps]
        sample[pos : pos + counts[c]] = pool
        pos += counts[c]
    return _group(owner, sample, num_clients)


def _sample_rows(probs: np.ndarray, rows: np.ndarray, u: np.ndarray, avail: np.ndarray) -> np.ndarray:
    """Draw one category per entry of `rows` from probs[row] by inverse CDF, vectorised.

    Row r's CDF is shifted by r, so one searchsorted over the flattened CDFs serves every row.
    """
    num_rows, num_cols = probs.shape
    cdf = np.cumsum(probs, axis=1)
    # Exact 1.0 from the last available category on, so no rounding reaches past it.
    last = int(np.flatnonzero(avail)[-1])
    cdf[:, last:] = 1.0
    flat = (cdf + np.arange(num_rows)[:, None]).ravel()
    idx = np.searchsorted(flat, rows + u, side="right") - rows * num_cols
    # rows + u can round up to rows + 1 for u within ~1e-14 of 1; such a draw takes the last label.
    return np.minimum(idx, last)


def _group(owner: np.ndarray, sample: np.ndarray, num_clients: int) -> list[np.ndarray]:
    by_owner = np.argsort(owner, kind="stable")
    bounds = np.cumsum(np.bincount(owner, minlength=num_clients))[:-1]
    return _finish(np.split(sample[by_owner], bounds))


@PARTITIONERS.register("dirichlet_unbalanced")
def dirichlet_unbalanced(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, alpha: float, **options: Any
) -> list[np.ndarray]:
    """Per-class Dirichlet split: each class's samples are split over clients by q ~ Dir(alpha * 1).

    Every sample is assigned, and client sizes differ. A client left with no sample at all then
    receives one random sample from the currently largest client, so every client can train.
    """
    labels = _check(labels, num_clients)
    alpha = _check_alpha(alpha)
    owner = np.empty(labels.size, dtype=np.int64)
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        q = np.nan_to_num(rng.dirichlet(np.full(num_clients, alpha)), nan=0.0)
        if q.sum() <= 0:  # every share underflowed: give the class to one random client
            q = np.eye(num_clients)[rng.integers(num_clients)]
        cuts = np.minimum(np.floor(np.cumsum(q / q.sum()) * idx.size).astype(np.int64), idx.size)
        cuts[-1] = idx.size  # the cumulative sum may end a rounding error short of 1
        owner[idx] = np.repeat(np.arange(num_clients), np.diff(cuts, prepend=0))
    sizes = np.bincount(owner, minlength=num_clients)
    for k in np.flatnonzero(sizes == 0):
        donor = int(np.argmax(sizes))
        moved = rng.choice(np.flatnonzero(owner == donor))
        owner[moved] = k
        sizes[donor] -= 1
        sizes[k] += 1
    if sizes.min() == 0:  # unreachable while num_clients <= N; kept as a guard on the invariant
        raise AssertionError("dirichlet_unbalanced left a client empty")
    return _group(owner, np.arange(labels.size), num_clients)


@PARTITIONERS.register("pathological")
def pathological(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, labels_per_client: int, **options: Any
) -> list[np.ndarray]:
    """Each client holds exactly Lambda = `labels_per_client` distinct labels.

    The K * Lambda (client, label) slots are shared out so each label is held by
    floor(K * Lambda / C) or one more clients (which labels get one more is random). Clients pick
    their labels greedily among those with the most holder slots left (ties broken at random),
    which always completes. Each label's samples are then split equally (sizes differ by at most
    one) among its holders; labels held by no client (only when K * Lambda < C) are left out,
    otherwise every sample is assigned.
    """
    labels = _check(labels, num_clients)
    lam = labels_per_client
    classes, y = np.unique(labels, return_inverse=True)
    num_classes = classes.size
    if isinstance(lam, bool) or not isinstance(lam, (int, np.integer)) or lam < 1:
        raise ValueError(f"labels_per_client={lam!r}: must be a positive integer")
    if lam > num_classes:
        raise ValueError(f"labels_per_client={lam} is more than the {num_classes} classes present in the labels")
    slots = num_clients * lam
    need = np.full(num_classes, slots // num_classes)
    need[rng.choice(num_classes, size=slots % num_classes, replace=False)] += 1
    class_sizes = np.bincount(y, minlength=num_classes)
    short = np.flatnonzero(class_sizes < need)
    if short.size:
        c = short[0]
        raise ValueError(
            f"pathological: label {classes[c]} has {class_sizes[c]} samples but must be shared by {need[c]} clients "
            f"({num_clients} clients x {lam} labels over {num_classes} classes); use fewer clients or labels_per_client"
        )

    held = np.empty((num_clients, lam), dtype=np.int64)
    left = need.copy()
    for k in range(num_clients):
        # Largest remaining need first; random keys break ties (lexsort: last key is primary).
        pick = np.lexsort((rng.random(num_classes), -left))[:lam]
        held[k] = pick
        left[pick] -= 1
    held = held[rng.permutation(num_clients)]  # the greedy order must not leak into client ids

    owner = np.empty(labels.size, dtype=np.int64)
    owner.fill(-1)
    for c in range(num_classes):
        holders = np.flatnonzero((held == c).any(axis=1))
        if holders.size == 0:
            continue
        idx = rng.permutation(np.flatnonzero(y == c))
        for k, chunk in zip(rng.permutation(holders), np.array_split(idx, holders.size)):
            owner[chunk] = k
    used = owner >= 0
    return _group(owner[used], np.flatnonzero(used), num_clients)


def label_histogram(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Counts of each label per client: an int64 array of shape (clients, classes)."""
    labels = np.asarray(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels range over [{labels.min()}, {labels.max()}], outside [0, {num_classes})")
    hist = np.zeros((len(parts), num_classes), dtype=np.int64)
    for k, part in enumerate(parts):
        hist[k] = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
    return hist


def save_label_heatmap(histogram: np.ndarray, path: str, title: str = "") -> None:
    """Write a PNG heat map of a (clients x classes) label histogram, with a colour bar."""
    # Figure + its own Agg canvas rather than pyplot: no global figure state, no backend switch,
    # and it works in worker processes without a display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    histogram = np.asarray(histogram)
    num_clients, num_classes = histogram.shape
    fig = Figure(figsize=(max(4.0, 0.3 * num_classes + 2.0), max(3.0, min(12.0, 0.12 * num_clients + 2.0))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(histogram, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=ax, label="samples")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # clients and classes are whole numbers
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        ax.set_title(title)
    fig.tight_layout()
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    logger.debug("wrote label heat map %s", path)
