"""DeepCo: partitioned CNN inference at the network edge, and a training scheduler on the same cluster."""

__version__ = "0.1.0"
