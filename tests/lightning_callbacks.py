"""A Lightning callback for tests/test_lightning.py, importable by path (`fl.callbacks`) and by the test alike."""

import lightning as L

BATCHES: list[int] = []
"""One entry per training batch a client's Trainer ran the callback on."""


class CountingCallback(L.Callback):
    def on_train_batch_end(self, *args: object) -> None:
        BATCHES.append(1)
