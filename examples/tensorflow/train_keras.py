"""Keras ResNet-50 on TensorFlow, data-parallel across every process of the job: TF_CONFIG (set by clusterfit
for distribution.type: tensorflow) names the workers, MultiWorkerMirroredStrategy allreduces the gradients.

The loop is a custom one because Keras 3's `model.fit` fails under MultiWorkerMirroredStrategy
(keras-team/keras#20585); the model, layers, losses and optimizer are Keras 3's. Progress goes to clusterfit
through clusterfit.session (status, metrics, hang detection), one checkpoint per epoch, and a restarted job
resumes from the last complete one.

    python train_keras.py --data synthetic            # random images of 10 classes
    python train_keras.py --data data/tiny            # an ImageNet-layout folder: train/<class>/*.jpg
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from clusterfit import session

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, as clusterfit's PyTorch trainer
WEIGHTS, OPTIMIZER_STATE = "model.weights.h5", "optimizer.npz"


def synthetic_images(size: int, classes: int, count: int) -> tf.data.Dataset:
    rng = np.random.default_rng(0)  # the same images on every worker; the strategy splits each batch
    images = rng.random((count, size, size, 3), dtype=np.float32) * 255
    labels = rng.integers(0, classes, count)
    return tf.data.Dataset.from_tensor_slices((images, labels))


def folder_images(root: Path, size: int) -> tuple[tf.data.Dataset, int]:
    """train/<class>/*.jpg, classes in sorted order, resized to size x size."""
    train = keras.utils.image_dataset_from_directory(
        root / "train", image_size=(size, size), batch_size=None, shuffle=True, seed=0, verbose=False
    )
    return train, len(train.class_names)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="synthetic", help="'synthetic' or an ImageNet-layout folder")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-epoch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    # clusterfit gives each worker its share of the node's cores in OMP_NUM_THREADS; TensorFlow's own thread
    # pools would otherwise each take every core, and the workers of a node would fight over them.
    threads = int(os.environ.get("OMP_NUM_THREADS", "0"))
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    ctx = session.context()
    global_batch = args.batch_size * strategy.num_replicas_in_sync
    if args.data == "synthetic":
        classes = 10
        images = synthetic_images(args.image_size, classes, global_batch * args.steps_per_epoch)
    else:
        images, classes = folder_images(Path(args.data), args.image_size)
    normalise = keras.layers.Normalization(mean=[m * 255 for m in MEAN], variance=[(s * 255) ** 2 for s in STD])
    batches = images.repeat().batch(global_batch, drop_remainder=True).map(lambda x, y: (normalise(x), y))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = iter(strategy.experimental_distribute_dataset(batches.with_options(options)))

    with strategy.scope():
        model = keras.applications.ResNet50(weights=None, input_shape=(args.image_size,) * 2 + (3,), classes=classes)
        optimizer = keras.optimizers.SGD(args.lr, momentum=0.9)
        optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=False, reduction="none")

    start_epoch = 0
    resume = session.latest_checkpoint()
    if resume is not None:  # every rank wrote the same state: read this rank's part
        model.load_weights(resume.folder / WEIGHTS)
        saved = np.load(resume.folder / OPTIMIZER_STATE)
        for variable, value in zip(optimizer.variables, (saved[key] for key in saved.files), strict=True):
            variable.assign(value)
        start_epoch = resume.step + 1

    def replica_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=global_batch)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_step(batch: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    for epoch in range(start_epoch, args.epochs):
        started = time.perf_counter()
        for step in range(epoch * args.steps_per_epoch, (epoch + 1) * args.steps_per_epoch):
            loss = float(train_step(next(dataset)))
            session.report(step=step, loss=loss)
        images_per_s = global_batch * args.steps_per_epoch / (time.perf_counter() - started)
        session.report(step=step, images_per_s=images_per_s, epoch=epoch)
        with session.checkpoint(epoch) as folder:
            model.save_weights(folder / WEIGHTS)
            np.savez(folder / OPTIMIZER_STATE, *[np.asarray(variable) for variable in optimizer.variables])
        if session.should_stop():
            break
    if ctx.is_main:
        print(json.dumps({"workers": strategy.num_replicas_in_sync, "loss": loss, "images_per_s": images_per_s}))


if __name__ == "__main__":
    main()
