"""Hyperparameter sweeps: trials of one job spec side by side in the job service's queue, chosen and pruned by
Optuna, with the study kept in a database so a sweep survives a restart of its driver."""
