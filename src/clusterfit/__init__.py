"""clusterfit: distributed training of image classifiers from one job spec."""

__version__ = "0.1.0"
