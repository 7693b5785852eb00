"""A user's TensorFlow program with a Keras 3 model: the workers named in TF_CONFIG form one
MultiWorkerMirroredStrategy cluster and fit a small regression in a custom loop (Keras 3's `model.fit` fails
under that strategy, keras-team/keras#20585). Each worker reports its loss through clusterfit.session and
prints one JSON line: the strategy's replica count, its final weights' digest and its first and last epoch
loss, so that a test can check that the workers agree and that the model learned."""

from __future__ import annotations

import hashlib
import json

import keras
import numpy as np
import tensorflow as tf

from clusterfit import session

GLOBAL_BATCH = 64
EPOCHS = 4


def main() -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    features = rng.normal(size=(512, 8)).astype("float32")
    targets = features @ rng.normal(size=(8, 1)).astype("float32")
    # Every worker builds the same global batches; the strategy gives each its share of every batch.
    batches = tf.data.Dataset.from_tensor_slices((features, targets)).batch(GLOBAL_BATCH)
    dataset = strategy.experimental_distribute_dataset(batches)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.05)
        optimizer.build(model.trainable_variables)

    def replica_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x, training=True) - y)) / GLOBAL_BATCH
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_step(batch: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    epoch_losses, step = [], 0
    for _ in range(EPOCHS):
        losses = []
        for batch in dataset:
            losses.append(float(train_step(batch)))
            session.report(step=step, loss=losses[-1])
            step += 1
        epoch_losses.append(sum(losses) / len(losses))
    digest = hashlib.sha256(b"".join(np.asarray(weight).tobytes() for weight in model.get_weights())).hexdigest()
    replicas = strategy.num_replicas_in_sync
    print(json.dumps({"replicas": replicas, "digest": digest, "first": epoch_losses[0], "last": epoch_losses[-1]}))


if __name__ == "__main__":
    main()
