"""How a camera frame becomes a model's input: the model card (``unet.toml`` beside ``unet.onnx``, or ``model.toml``
in the model's folder) and flags.

A frame is cropped or stretched to the model's input size, turned into the model's channels (RGB, BGR or
grey) and sent as uint8 pixels p; the model's graph gets x = (p * scale - mean_c) / std_c in front
(deepco.partition.pixels). The zoo's models take torchvision's ImageNet recipe; an ONNX file given by path
takes the same unless its card or the flags say otherwise. A card::

    [input]
    channels = 1             # 1 (grey) or 3
    order = "rgb"            # "rgb" or "bgr" (3 channels only)
    mean = [0.1307]          # one value per channel (or one value for every channel)
    std = [0.3081]
    scale = 0.00392156862745098  # 1/255: pixels to [0, 1] (1.0 keeps 0..255)
    resize = "crop"          # "crop": centre-crop to the input's aspect ratio, then resize; "stretch": resize only

    [output]
    kind = "detections"      # "labels" (top classes), "detections" (boxes), "mask" (classes per pixel) or "raw"
    score_threshold = 0.25   # detections: the least class score kept
    iou_threshold = 0.45     # detections: NMS drops a box overlapping a better one of its class more than this
    class_names = ["person", "bicycle"]  # detections and mask: class i's name (default "class i")

Flags (``--channels``, ``--mean``, ...) override the card key by key. Nothing here imports the device.
"""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from deepco.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
RESIZE = ("crop", "stretch")
ORDERS = ("rgb", "bgr")
OUTPUTS = ("auto", "labels", "raw", "detections", "mask")
INPUT_KEYS = {"channels", "order", "mean", "std", "scale", "resize"}
OUTPUT_KEYS = {"kind", "score_threshold", "iou_threshold", "class_names"}
# The zoo's own cards (the zoo's models have no file beside them): what their outputs are. Here rather than in
# deepco.zoo, which imports torch: reading a card must stay light on the CLI's start.
ZOO_CARDS: dict[str, dict] = {"yolov8n": {"output": "detections"}, "unet": {"output": "mask"}}


@dataclass(frozen=True)
class Preprocessing:
    """How a frame becomes a model input (see the module doc). ``origin`` says where it came from."""

    channels: int = 3
    rgb: bool = True  # OpenCV decodes BGR; torchvision-trained models expect RGB
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    scale: float = 1.0 / 255.0
    resize: str = "crop"
    output: str = "auto"
    score_threshold: float = 0.25  # detections (Ultralytics' defaults)
    iou_threshold: float = 0.45
    class_names: tuple[str, ...] = ()  # empty: "class i"
    origin: str = "ImageNet's defaults"

    def class_name(self, i: int) -> str:
        """Class ``i``'s name from the card, else ``class i``."""
        return self.class_names[i] if 0 <= i < len(self.class_names) else f"class {i}"

    @property
    def center_crop(self) -> bool:
        """Crop to the input's aspect ratio before resizing, so objects are not squashed."""
        return self.resize == "crop"

    def describe(self) -> str:
        """One line for the log."""
        colour = "grey" if self.channels == 1 else ("RGB" if self.rgb else "BGR")
        nums = lambda v: ",".join(f"{x:g}" for x in v)  # noqa: E731
        return (f"{self.channels}-channel {colour}, x = (p * {self.scale:.6g} - [{nums(self.mean)}]) / "
                f"[{nums(self.std)}], {self.resize} ({self.origin})")


IMAGENET = Preprocessing()


def card_path(model: str) -> Path | None:
    """The model card of ``model`` (an ONNX file): ``<stem>.toml`` beside it, else ``model.toml`` in its folder
    (a folder per model, as model repositories lay them out); the stem's wins; None if there is neither."""
    if not model.endswith(".onnx"):
        return None
    own = Path(model).with_suffix(".toml")
    shared = Path(model).with_name("model.toml")
    return next((p for p in (own, shared) if p.is_file()), None)


def read_card(path: str | Path) -> dict:
    """The settings of a model card as flag-like keys (channels, order, mean, std, scale, resize, output)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(f"model card {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"model card {str(p)!r} is not valid TOML: {exc}".splitlines()[0]) from None
    unknown = sorted(set(data) - {"input", "output"})
    unknown += [f"input.{k}" for k in sorted(set(data.get("input", {})) - INPUT_KEYS)]
    unknown += [f"output.{k}" for k in sorted(set(data.get("output", {})) - OUTPUT_KEYS)]
    if unknown:
        raise UserError(f"model card {str(p)!r}: unknown key(s) {', '.join(unknown)} (known: [input] "
                        f"{', '.join(sorted(INPUT_KEYS))}; [output] {', '.join(sorted(OUTPUT_KEYS))})")
    settings = dict(data.get("input", {}))
    output = dict(data.get("output", {}))
    if "kind" in output:
        settings["output"] = output.pop("kind")
    return settings | output


def build(settings: dict, base: Preprocessing = IMAGENET, origin: str = "") -> Preprocessing:
    """``base`` with ``settings`` (card keys) applied and checked; a bad value is a one-line UserError."""
    where = f" ({origin})" if origin else ""

    def number_list(key: str) -> tuple[float, ...]:
        value = settings[key]
        values = value if isinstance(value, list | tuple) else [value]
        try:
            return tuple(float(v) for v in values)
        except (TypeError, ValueError):
            raise UserError(f"{key} must be numbers, got {value!r}{where}") from None

    changes: dict = {}
    if "channels" in settings:
        if settings["channels"] not in (1, 3):
            raise UserError(f"channels must be 1 or 3, got {settings['channels']!r}{where}")
        changes["channels"] = int(settings["channels"])
    if "order" in settings:
        if settings["order"] not in ORDERS:
            raise UserError(f"order must be rgb or bgr, got {settings['order']!r}{where}")
        changes["rgb"] = settings["order"] == "rgb"
    for key in ("mean", "std"):
        if key in settings:
            changes[key] = number_list(key)
    if "scale" in settings:
        values = number_list("scale")
        scale = values[0] if len(values) == 1 else 0.0
        if not scale > 0:
            raise UserError(f"scale must be positive, got {settings['scale']!r}{where}")
        changes["scale"] = scale
    if "resize" in settings:
        if settings["resize"] not in RESIZE:
            raise UserError(f"resize must be crop or stretch, got {settings['resize']!r}{where}")
        changes["resize"] = settings["resize"]
    if "output" in settings:
        if settings["output"] not in OUTPUTS:
            raise UserError(f"output must be one of {', '.join(OUTPUTS)}, got {settings['output']!r}{where}")
        changes["output"] = settings["output"]
    changes |= _output_settings(settings, where)
    how = replace(base, **changes, origin=origin or base.origin)
    c = how.channels
    if c != 3 and ("mean" not in changes or "std" not in changes) and how.mean == IMAGENET_MEAN:
        raise UserError(f"a {c}-channel input needs its own mean and std (ImageNet's are for RGB): give --mean "
                        f"and --std, or mean and std in the model card{where}")
    mean, std = how.mean, how.std
    for key, values in (("mean", mean), ("std", std)):
        if len(values) not in (1, c):
            raise UserError(f"{key} has {len(values)} values for {c} channel(s){where}")
    mean, std = (mean * c if len(mean) == 1 else mean), (std * c if len(std) == 1 else std)
    if min(std) <= 0:
        raise UserError(f"std must be positive, got {list(std)}{where}")
    return replace(how, mean=mean, std=std)


def _output_settings(settings: dict, where: str) -> dict:
    """The checked [output] keys besides ``kind``, as Preprocessing fields."""
    changes: dict = {}
    for key in ("score_threshold", "iou_threshold"):
        if key in settings:
            value = settings[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                raise UserError(f"{key} must be a number from 0 to 1, got {value!r}{where}")
            changes[key] = float(value)
    if "class_names" in settings:
        names = settings["class_names"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise UserError(f"class_names must be a list of strings, got {names!r}{where}")
        changes["class_names"] = tuple(names)
    return changes


def add_arguments(p: argparse.ArgumentParser, output: bool = False) -> None:
    """The preprocessing flags (and, with ``output``, --output and --output-dir) of commands that take a model."""
    g = p.add_argument_group("your own model's preprocessing (override its model card, see docs/formats.md)")
    g.add_argument("--model-card", metavar="FILE.toml",
                   help="the model card (default: MODEL.toml beside MODEL.onnx, else model.toml in its folder)")
    g.add_argument("--channels", type=int, choices=[1, 3], help="1 (grey pixels 1xHxW) or 3 (default 3)")
    g.add_argument("--color-order", choices=list(ORDERS), help="channel order of a 3-channel input (default rgb)")
    g.add_argument("--mean", metavar="M[,M,M]", help="per-channel mean after scaling (default ImageNet's "
                   f"{','.join(map(str, IMAGENET_MEAN))})")
    g.add_argument("--std", metavar="S[,S,S]", help="per-channel standard deviation after scaling (default "
                   f"ImageNet's {','.join(map(str, IMAGENET_STD))})")
    g.add_argument("--scale", type=float, help="pixel scale before normalising (default 1/255; 1 keeps 0..255)")
    g.add_argument("--resize", choices=list(RESIZE),
                   help="crop: centre-crop to the input's aspect ratio, then resize (default); stretch: resize only")
    if output:
        g.add_argument("--output", choices=list(OUTPUTS), default=None,
                       help="labels: top-3 classes per frame; detections: boxes decoded from YOLOv8-style heads, "
                            "NMS; mask: each pixel's class (the share of each per frame); raw: save every output "
                            "tensor to --output-dir; auto (default): the model card's kind (the zoo's yolov8n: "
                            "detections, unet: mask), else labels for a 1000-class output, else every output's "
                            "shape and range")
        g.add_argument("--output-dir", metavar="DIR", default="deepco-outputs",
                       help="where --output raw writes frame-NNNNNN.npy, or frame-NNNNNN-<output name>.npy per output "
                            "for a model with several (default ./deepco-outputs)")


def _flag_list(text: str, flag: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} must be numbers separated by commas, got {text!r}") from None


def from_args(model: str, args: argparse.Namespace) -> Preprocessing:
    """The preprocessing of ``model``: the zoo's (ImageNet), else its card, then the flags on top."""
    base, origin = IMAGENET, "ImageNet's defaults"
    if model in ZOO_CARDS:
        base = build(ZOO_CARDS[model], IMAGENET, origin)
    card = getattr(args, "model_card", None)
    path = Path(card) if card else card_path(model)
    if path is not None:
        base = build(read_card(path), IMAGENET, f"model card {path}")
        origin = f"model card {path}"
    flags: dict = {}
    if getattr(args, "channels", None) is not None:
        flags["channels"] = args.channels
    if getattr(args, "color_order", None) is not None:
        flags["order"] = args.color_order
    for key in ("mean", "std"):
        if getattr(args, key, None) is not None:
            flags[key] = _flag_list(getattr(args, key), f"--{key}")
    if getattr(args, "scale", None) is not None:
        flags["scale"] = args.scale
    if getattr(args, "resize", None) is not None:
        flags["resize"] = args.resize
    if getattr(args, "output", None) is not None:
        flags["output"] = args.output
    if not flags:
        return base
    return build(flags, base, f"{origin} + flags" if path is not None else "flags")


def to_argv(args: argparse.Namespace) -> list[str]:
    """The preprocessing flags of ``args`` as command-line arguments (to hand them to a worker process)."""
    argv: list[str] = []
    for flag in ("model_card", "channels", "color_order", "mean", "std", "scale", "resize"):
        value = getattr(args, flag, None)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    return argv


def check_input(model: onnx.ModelProto, how: Preprocessing) -> None:
    """A one-line UserError when ``model``'s image input cannot take ``how``'s pixels (before any ORT run)."""
    inits = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1:
        names = ", ".join(i.name for i in inputs) or "none"
        raise UserError(f"the model must have exactly one image input, it has {len(inputs)} ({names})")
    tensor = inputs[0].type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim]
    shape = "x".join(map(str, dims)) or "?"
    name = inputs[0].name
    if tensor.elem_type != onnx.TensorProto.FLOAT:
        kind = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        raise UserError(f"the model's input {name!r} is {kind}, not float32: DeepCo feeds normalised float32 "
                        "images (NCHW)")
    if len(dims) != 4:
        raise UserError(f"the model's input {name!r} has shape {shape}: DeepCo needs a 4-d NCHW image input")
    channels = dims[1]
    if isinstance(channels, int) and channels not in (1, 3) and dims[3] in (1, 3):
        raise UserError(f"the model's input {name!r} has shape {shape}, channels last (NHWC): DeepCo partitions "
                        "NCHW models; export it channels first")
    if isinstance(channels, int) and channels != how.channels:
        fix = (f"--channels {channels} with its --mean and --std" if channels in (1, 3)
               else "DeepCo sends 1 or 3 channels")
        raise UserError(f"the model's input {name!r} takes {channels} channel(s) (shape {shape}) but the "
                        f"preprocessing gives {how.channels} ({how.origin}): {fix}, or a model card")


SEEDED_PROPERTY = "deepco_seeded_weights"  # in the metadata of a zoo export on seeded random weights


def seeded_weights(model: onnx.ModelProto) -> bool:
    """Whether ``model`` is a zoo export on seeded random weights (deepco.zoo.export says so in its metadata,
    so a kept export says it without the zoo): its labels mean nothing."""
    return any(p.key == SEEDED_PROPERTY and p.value == "true" for p in model.metadata_props)
