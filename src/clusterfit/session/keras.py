"""One Keras callback: `model.fit(..., callbacks=[ReportCallback()])` reports every batch's logs (loss and
metrics) to clusterfit. Keras is imported only when this module is."""

from __future__ import annotations

from typing import Any

import keras

from clusterfit import session


class ReportCallback(keras.callbacks.Callback):
    """Reports each training batch's logs at a global step that keeps counting across epochs."""

    def __init__(self, every_batches: int = 1) -> None:
        super().__init__()
        self.every_batches = every_batches
        self.step = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.step % self.every_batches == 0:
            session.report(step=self.step, **{key: float(value) for key, value in (logs or {}).items()})
        self.step += 1
