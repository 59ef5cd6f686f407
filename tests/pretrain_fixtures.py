"""A few hundred tokens of SST-2- and AG-News-shaped text, and a tiny pretraining config over them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SST2_ROWS = [
    "hide new secretions from the parental units ",
    "contains no wit , only labored gags ",
    "that loves its characters and communicates something rather beautiful about human nature ",
    "remains utterly satisfied to remain the same throughout ",
    "on the worst revenge-of-the-nerds clichés the filmmakers could dredge up ",
    "that 's far too tragic to merit such superficial treatment ",
    "demonstrates that the director of such hollywood blockbusters as patriot games can still turn out a small film ",
    "of saucy ",
]
AG_NEWS_ROWS = [
    ('3', "Fears for T N pension after talks", "Unions representing workers at Turner   Newall say they are 'disappointed'."),
    ('4', "The Race is On (SPACE.com)", "SPACE.com - A second\\team of rocketeers competing for the  #36;10 million prize."),
    ('4', "Ky. Company Wins Grant", "AP - A company founded by a chemistry researcher won a  quot;grant quot; to study peptides."),
]


def write_text_corpus(root: Path) -> Path:
    """SST-2's train.tsv and AG News' test.csv, laid out as under the data root."""
    sst2 = root / "sst2" / "SST-2"
    sst2.mkdir(parents=True)
    (sst2 / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(SST2_ROWS)))
    ag = root / "ag_news" / "ag_news_csv"
    ag.mkdir(parents=True)
    (ag / "test.csv").write_text("".join(f'"{c}","{t}","{d}"\n' for c, t, d in AG_NEWS_ROWS))
    return root


def tiny_family(root: Path, cache: Path, **changes: Any) -> dict[str, Any]:
    """A family of 1- and 2-block language models, embedding 16, context 32: 12 steps of 4 windows."""
    values = {
        "family": "tiny", "model": "gpt", "depths": [1, 2], "dim": 16, "heads": 2, "context": 32,
        "corpus": "sst2_agnews", "tokenizer": "chars", "budget": 12 * 4 * 32, "batch_size": 4,
        "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "eval_fraction": 0.2, "checkpoint_every": 5,
        "device": "cpu", "threads": 1, "data_root": str(root), "cache_dir": str(cache),
    }
    values.update(changes)
    return values


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def write_cifar_zip(root: Path, per_class: int = 4) -> Path:
    """A CIFAR-10 JPEG zip as under the data root: `per_class` random 32x32 training images per
    class (and one test image each), each class a different mean colour so there is something to learn."""
    import io
    import zipfile

    import numpy as np
    from PIL import Image

    folder = root / "cifar10_jpeg"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    with zipfile.ZipFile(folder / "cifar10-jpeg.zip", "w") as zf:
        for c, name in enumerate(CIFAR10_CLASSES):
            for split, count in (("train", per_class), ("test", 1)):
                for i in range(count):
                    buffer = io.BytesIO()
                    Image.fromarray((rng.random((32, 32, 3)) * 64 + c * 19).astype(np.uint8)).save(buffer, "JPEG")
                    zf.writestr(f"{split}/{name}/{i:04d}.jpg", buffer.getvalue())
    return root
