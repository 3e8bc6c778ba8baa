"""Detection and segmentation as a user sees them (issue 29, item 5).

- YOLOv8 heads decode to the boxes put into them (expected corners computed here by hand, from the anchor
  and the DFL distances), NMS (OpenCV) drops a same-class box overlapping a better one more than the IoU
  threshold and keeps other classes' boxes.
- A mask is each pixel's class (argmax; one channel: over 0.5 as a probability, else as a logit).
- The model card's [output] kinds and their keys are parsed; bad values are refused in one line; the zoo's
  yolov8n and unet are detections and mask without a card.
- `deepco run --annotate` writes a video OpenCV reads back with one frame per frame that entered, at the
  source's frame rate, on real servers; an unwritable path is one line, exit 2, before anything runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2
import numpy as np
import pytest
from deepco_device.annotate import Annotated
from deepco_device.readings import Detections, Labels, Mask, detect, mask_of

from deepco import modelcard
from deepco.cli import main
from deepco.errors import UserError

H = W = 64  # heads 8x8 (stride 8), 4x4 (16), 2x2 (32)
CLASSES = 3


def heads() -> list[np.ndarray]:
    """Empty YOLOv8 heads: uniform DFL bins, every class score 0."""
    return [np.zeros((1, 64 + CLASSES, H // s, W // s), np.float32) for s in (8, 16, 32)]


def put(head: np.ndarray, x: int, y: int, dist: tuple[int, int, int, int], cls: int, score: float) -> None:
    """A box at cell (x, y): each side's DFL bins one-hot (logit 30) at its distance in cells."""
    for side, d in enumerate(dist):
        head[0, side * 16:(side + 1) * 16, y, x] = 0.0
        head[0, side * 16 + d, y, x] = 30.0
    head[0, 64 + cls, y, x] = score


def synthetic() -> list[np.ndarray]:
    p3, p4, p5 = heads()
    put(p3, 3, 2, (2, 1, 3, 2), 1, 0.9)   # anchor (3.5, 2.5) * 8: (12, 12, 52, 36)
    put(p3, 4, 2, (3, 1, 2, 2), 1, 0.6)   # anchor (4.5, 2.5): the same box, worse: suppressed
    put(p3, 3, 3, (2, 2, 3, 1), 2, 0.5)   # the same box, another class: kept
    put(p3, 5, 2, (3, 1, 3, 2), 1, 0.65)  # anchor (5.5, 2.5): (20, 12, 68, 36), IoU 768 / 1344 with the first
    put(p5, 1, 0, (1, 0, 0, 1), 0, 0.8)   # anchor (1.5, 0.5) * 32: (16, 16, 48, 48)
    put(p4, 2, 2, (1, 1, 1, 1), 0, 0.2)   # under the score threshold
    return [p3, p4, p5]


def boxes(found) -> list[tuple]:
    return [(tuple(round(v, 3) for v in d.box), d.cls, round(d.score, 3)) for d in found]


def test_detections_decode_and_nms():
    first, other_class, person = ((12, 12, 52, 36), 1, 0.9), ((12, 12, 52, 36), 2, 0.5), ((16, 16, 48, 48), 0, 0.8)
    overlapping = ((20, 12, 68, 36), 1, 0.65)
    iou = (52 - 20) * (36 - 12) / (40 * 24 + 48 * 24 - (52 - 20) * (36 - 12))
    assert 0.45 < iou < 0.6
    assert boxes(detect(synthetic(), H, 0.25, 0.45)) == [first, person, other_class]
    assert boxes(detect(synthetic(), H, 0.25, 0.6)) == [first, person, overlapping, other_class]
    assert boxes(detect(synthetic(), H, 0.7, 0.45)) == [first, person]
    assert detect(heads(), H, 0.25, 0.45) == []


def test_detections_line_names_classes_and_refuses_other_outputs():
    how = modelcard.build({"output": "detections", "class_names": ["person", "bike"]})
    line = Detections(detect(synthetic(), H, 0.25, 0.45), how).line()
    assert line == "3 detections (bike 0.90, person 0.80, class 2 0.50)"
    with pytest.raises(ValueError, match="16 DFL bins"):
        detect([np.zeros((1, 1000), np.float32)], H, 0.25, 0.45)


def test_mask_classes_per_pixel():
    logits = np.zeros((1, 3, 4, 4), np.float32)
    logits[0, 2, :2] = 1.0
    logits[0, 1, 3, 3] = 1.0
    want = np.zeros((4, 4), int)
    want[:2], want[3, 3] = 2, 1
    assert (mask_of(logits) == want).all()
    assert Mask(want, modelcard.IMAGENET).line() == "mask 4x4: class 2 50%, class 0 44%, class 1 6%"
    probability = np.array([[[[0.2, 0.7]]]], np.float32)
    logit = np.array([[[[-0.5, 0.3]]]], np.float32)
    assert mask_of(probability).tolist() == [[0, 1]] and mask_of(logit).tolist() == [[0, 1]]
    image = np.zeros((4, 4, 3), np.uint8)
    Mask(want, modelcard.IMAGENET).draw(image)
    assert (image[0, 0] != image[2, 0]).any()  # class 2 and class 0 drawn in different colours


def test_card_output_kinds_parsed_and_bad_values_refused(tmp_path):
    card = tmp_path / "det.toml"
    card.write_text('[output]\nkind = "detections"\nscore_threshold = 0.4\niou_threshold = 0.5\n'
                    'class_names = ["cat", "dog"]\n')
    how = modelcard.build(modelcard.read_card(card))
    assert (how.output, how.score_threshold, how.iou_threshold, how.class_names) == ("detections", 0.4, 0.5,
                                                                                    ("cat", "dog"))
    assert modelcard.build(modelcard.read_card(_card(tmp_path, 'kind = "mask"'))).output == "mask"
    for body, says in (('kind = "boxes"', "output must be one of auto, labels, raw, detections, mask"),
                       ("score_threshold = 1.5", "score_threshold must be a number from 0 to 1"),
                       ('iou_threshold = "high"', "iou_threshold must be a number from 0 to 1"),
                       ("class_names = [1, 2]", "class_names must be a list of strings"),
                       ("nms = 0.5", "unknown key(s) output.nms")):
        with pytest.raises(UserError, match=r"^[^\n]*" + says.replace("(", r"\(").replace(")", r"\)")) as exc:
            modelcard.build(modelcard.read_card(_card(tmp_path, body)))
        assert "\n" not in str(exc.value)
    flags = argparse.Namespace(output=None)
    assert modelcard.from_args("yolov8n", flags).output == "detections"
    assert modelcard.from_args("unet", flags).output == "mask"
    assert modelcard.from_args("resnet18", flags).output == "auto"
    assert modelcard.from_args("yolov8n", argparse.Namespace(output="raw")).output == "raw"


def _card(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "card.toml"
    path.write_text(f"[output]\n{body}\n")
    return path


def read_back(path: Path) -> tuple[list[np.ndarray], float]:
    capture = cv2.VideoCapture(str(path))
    frames = []
    while (ok := capture.read())[0]:
        frames.append(ok[1])
    fps = capture.get(cv2.CAP_PROP_FPS)
    capture.release()
    return frames, fps


def test_annotated_writes_every_frame_that_entered_once_in_order(tmp_path):
    """A failed frame is written marked (red), a frame with no result at the end too: none is lost."""
    out = tmp_path / "a.avi"
    video = Annotated(str(out), 32, 48, 5.0, rgb=True)
    for level in (40, 120, 200):
        video.entered(np.full((1, 3, 32, 48), level, np.uint8))
    video.result(Labels([("tabby", 0.9)]), None)
    video.result(None, "server s0 failed")
    video.close()
    frames, fps = read_back(out)
    assert len(frames) == 3 and fps == 5.0 and frames[0].shape == (32, 48, 3)
    assert all(abs(np.median(f) - level) < 15 for f, level in zip(frames, (40, 120, 200), strict=True))  # in order
    red = [int(((f[..., 2] > 150) & (f[..., 0] < 100)).sum()) for f in frames]
    assert red[0] == 0 and red[1] > 20 and red[2] > 20  # failed, no result: a red label


@pytest.fixture(scope="module")
def cluster(two_servers, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cluster") / "cluster.toml"
    lines = ["[device]", "antennas = 1", "bandwidth = 100.0"]
    for i, s in enumerate(two_servers):
        lines += ["[[servers]]", f'name = "s{i}"', "capacity = 1.0", f'address = "{s.address}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def clip(path: Path, frames: int, fps: float) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (80, 64))
    for k in range(frames):
        writer.write(np.full((64, 80, 3), 30 * k, np.uint8))
    writer.release()
    return path


def test_run_annotates_the_zoo_detector_on_real_servers(cluster, tmp_path, capsys):
    source, out = clip(tmp_path / "in.avi", 4, 7.0), tmp_path / "out.mp4"
    code = main(["run", "--cluster", str(cluster), "--model", "yolov8n", "--input-size", f"{H}x{W}",
                 "--source", str(source), "--algorithm", "offload", "--annotate", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    lines = [line for line in printed.splitlines() if line.startswith("frame ")]
    assert len(lines) == 4 and all("detection" in line for line in lines), printed
    frames, fps = read_back(out)
    assert len(frames) == 4 and fps == 7.0 and frames[0].shape == (H, W, 3)


@pytest.mark.parametrize("where", ["missing/out.mp4", "", "out.txt"])
def test_run_refuses_an_unwritable_annotation_in_one_line(where, cluster, tmp_path, capsys):
    target = str(tmp_path / where) if where else str(tmp_path)
    source = clip(tmp_path / "in.avi", 1, 5.0)
    code = main(["run", "--cluster", str(cluster), "--model", "yolov8n", "--input-size", f"{H}x{W}",
                 "--source", str(source), "--annotate", target])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("deepco run: error: --annotate") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_run_reads_the_zoo_unet_as_a_mask_and_raw_still_saves(cluster, tmp_path, capsys):
    source, raw = clip(tmp_path / "in.avi", 2, 5.0), tmp_path / "raw"
    args = ["run", "--cluster", str(cluster), "--model", "unet", "--input-size", "32x32", "--source", str(source),
            "--algorithm", "local"]
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("frame ")]
    assert len(lines) == 2 and all("mask 32x32: class " in line for line in lines), lines
    assert main([*args, "--output", "raw", "--output-dir", str(raw), "--annotate", str(tmp_path / "u.avi")]) == 0
    assert sorted(p.name for p in raw.iterdir()) == ["frame-000000.npy", "frame-000001.npy"]
    assert len(read_back(tmp_path / "u.avi")[0]) == 2
