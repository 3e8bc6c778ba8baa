"""Exact data-lookahead partitioning of CNNs: ONNX in, slices out (see DESIGN.md, `deepco partition`)."""

from deepco.partition.choose import Choice, choose_cut
from deepco.partition.graph import PartitionError, Stop
from deepco.partition.levels import Level, Stage, StageWindow
from deepco.partition.partitioner import Cut, Partitioner, SliceCost
from deepco.partition.segments import Segment, Window
from deepco.partition.shapes import SizeError, check_size, fold_shapes
from deepco.partition.source import load_model, load_onnx, model_flops

__all__ = [
    "Choice",
    "Cut",
    "Level",
    "PartitionError",
    "Partitioner",
    "Segment",
    "SizeError",
    "SliceCost",
    "Stage",
    "StageWindow",
    "Stop",
    "Window",
    "check_size",
    "choose_cut",
    "fold_shapes",
    "load_model",
    "load_onnx",
    "model_flops",
]
