"""The hand-written training loops `clusterfit bench train` measures clusterfit against: plain PyTorch, as a user
would write them for a throughput test. They import nothing of clusterfit's (only each other), so they stay
baselines; they ship inside the package, so the benchmark runs from an installed clusterfit too."""
