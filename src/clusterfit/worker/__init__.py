"""What runs inside each worker process: the training loop, checkpoints, evaluation and export."""
