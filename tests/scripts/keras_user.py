"""A user's Keras script for the session tests: one callback reports every batch's loss to clusterfit."""

from __future__ import annotations

import keras
import numpy as np

from clusterfit.session.keras import ReportCallback

rng = np.random.default_rng(0)
inputs = rng.normal(size=(64, 4)).astype("float32")
targets = inputs @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(inputs, targets, batch_size=16, epochs=2, verbose=0, callbacks=[ReportCallback()])
