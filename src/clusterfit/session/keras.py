"""Keras helpers over clusterfit.session: `model.fit(..., callbacks=[ReportCallback()])` reports every batch's
logs (loss and metrics); with `checkpoint_every_epochs` it also saves the model (weights and optimizer state)
as this process's part of a checkpoint, and `restore(model)` resumes from the latest complete one. Keras is
imported only when this module is."""

from __future__ import annotations

from typing import Any

import keras

from clusterfit import session

MODEL_FILE = "model.keras"


class ReportCallback(keras.callbacks.Callback):
    """Reports each training batch's logs at a global step that keeps counting across epochs (and across a
    resume); checkpoints at the end of every `checkpoint_every_epochs`-th epoch; ends `fit` at the end of a
    batch once the engine asks the job to stop (cancel, Slurm's time limit), so that the job resumes from the
    last epoch's checkpoint."""

    def __init__(self, every_batches: int = 1, checkpoint_every_epochs: int | None = None, keep: int = 2) -> None:
        super().__init__()
        self.every_batches = every_batches
        self.checkpoint_every_epochs = checkpoint_every_epochs
        self.keep = keep
        self.step = 0
        self._stopped_mid_epoch = False

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        steps_per_epoch = (self.params or {}).get("steps")
        if steps_per_epoch:  # known for arrays and sized datasets: a resumed fit continues the count
            self.step = epoch * steps_per_epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.step % self.every_batches == 0:
            session.report(step=self.step, **{key: float(value) for key, value in (logs or {}).items()})
        self.step += 1
        if self.checkpoint_every_epochs and session.should_stop():
            self._stopped_mid_epoch = True
            self.model.stop_training = True

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        every = self.checkpoint_every_epochs
        # NOTE: Keras ends a stopped epoch early but still calls this; that epoch is not complete, so not saved.
        if every and (epoch + 1) % every == 0 and not self._stopped_mid_epoch:
            with session.checkpoint(epoch, keep=self.keep) as folder:
                self.model.save(folder / MODEL_FILE)


def restore(model: keras.Model) -> int:
    """Loads the latest complete checkpoint (weights and optimizer state) into a built and compiled `model`;
    returns the epoch to pass as `fit(initial_epoch=...)`: 0 on a fresh job, the saved epoch + 1 after a
    restart."""
    resume = session.latest_checkpoint()
    if resume is None:
        return 0
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:  # its variables exist only from the first step otherwise
        optimizer.build(model.trainable_variables)
    model.load_weights(resume.folder / MODEL_FILE)
    return resume.step + 1
