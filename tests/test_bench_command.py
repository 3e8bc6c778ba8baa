"""`deepco bench`'s bookkeeping around the measured points (the measurements themselves: test_testbed_e2e)."""
import argparse
import copy
import json
from pathlib import Path

import pytest
from deepco_bench import bench_command

from deepco.errors import UserError

RECORDED = Path(__file__).resolve().parents[1] / "bench" / "results" / "bench" / "sweep-servers-camera-224.json"


def test_an_interrupted_run_keeps_the_repeats_it_finished(tmp_path, monkeypatch):
    """A ResNet-50 point takes 18 minutes a repeat: stopping the third must not lose the first two."""
    runs = json.loads(RECORDED.read_text())["points"][0]["runs"]
    measured = iter(runs[:2])

    def one_point(*_args):
        try:
            return copy.deepcopy(next(measured))
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(bench_command, "one_point", one_point)
    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--preset", "camera", "--input-size", "224x224", "--repeat", "3", "--json", str(out)])
    with pytest.raises(KeyboardInterrupt):
        bench_command.run(args)
    [point] = json.loads(out.read_text())["points"]
    assert point["repeats"] == 2 and len(point["runs"]) == 2
    assert point["algorithms"].keys() == runs[0]["algorithms"].keys()


def test_a_plot_that_cannot_be_written_is_a_one_line_error(tmp_path):
    document = json.loads(RECORDED.read_text())
    bench_command.plot(document, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(UserError, match="cannot write the plot"):
        bench_command.plot(document, str(tmp_path / "no-such-folder" / "sweep.png"))


def test_frames_until_adapted_is_the_first_frame_from_which_every_ten_stay_within_15_percent():
    from deepco_bench.scenarios import frames_until_adapted

    fresh = 0.100
    # 8 slow frames after the change: the windows of ten from frames 0..3 hold 5+ slow ones (their p50 is slow,
    # or halfway), from frame 4 on at most 4 of ten are and the p50 is the fresh level's; a later hiccup moves
    # nothing
    after = [0.400] * 8 + [0.105] * 20 + [0.900] + [0.098] * 15
    assert frames_until_adapted(after, fresh) == 4
    assert frames_until_adapted([0.400] * 30, fresh) is None  # never adapted within the phase
    assert frames_until_adapted([0.400] * 8 + [0.105] * 20 + [0.400] * 12, fresh) is None  # and fell back
