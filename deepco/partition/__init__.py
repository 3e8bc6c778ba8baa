"""Exact data-lookahead partitioning of CNNs: ONNX in, slices out (see DESIGN.md, `deepco partition`)."""

from deepco.partition.choose import Choice, choose_cut
from deepco.partition.graph import PartitionError, Stop
from deepco.partition.partitioner import Cut, Partitioner, SliceCost
from deepco.partition.segments import Segment, Window
from deepco.partition.source import load_model, load_onnx, model_flops

__all__ = [
    "Choice",
    "Cut",
    "PartitionError",
    "Partitioner",
    "Segment",
    "SliceCost",
    "Stop",
    "Window",
    "choose_cut",
    "load_model",
    "load_onnx",
    "model_flops",
]
