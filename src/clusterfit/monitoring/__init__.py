"""Where metrics go while a job runs: JSONL (read by the CLI's progress bar), TensorBoard, logs."""
