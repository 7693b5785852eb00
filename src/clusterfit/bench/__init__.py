"""Benchmarks run from the command line (`clusterfit bench ...`)."""
