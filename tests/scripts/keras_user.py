"""A user's Keras script for the session tests: one callback reports every batch's loss to clusterfit and, with
--checkpoint, saves each epoch; `restore` resumes a restarted run. --kill-at-epoch ends the first attempt
abruptly when that epoch begins, as a lost process would."""

from __future__ import annotations

import argparse
import os

import keras
import numpy as np

from clusterfit import session
from clusterfit.session.keras import ReportCallback, restore


class DieOnFirstAttempt(keras.callbacks.Callback):
    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == self.epoch and session.context().attempt == 1:
            session.wait_for_checkpoints()  # the previous epoch's, published: then die as a crash would
            os._exit(3)


parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--checkpoint", action="store_true")
parser.add_argument("--kill-at-epoch", type=int)
args = parser.parse_args()

rng = np.random.default_rng(0)
inputs = rng.normal(size=(64, 4)).astype("float32")
targets = inputs @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
start = restore(model) if args.checkpoint else 0
optimizer_steps = int(model.optimizer.iterations)
print(f"attempt {session.context().attempt} starts at epoch {start} after {optimizer_steps} optimizer steps")
callbacks = [ReportCallback(checkpoint_every_epochs=1 if args.checkpoint else None)]
if args.kill_at_epoch is not None:
    callbacks.append(DieOnFirstAttempt(args.kill_at_epoch))
model.fit(inputs, targets, batch_size=16, epochs=args.epochs, initial_epoch=start, verbose=0, callbacks=callbacks)
