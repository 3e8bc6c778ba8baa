"""MoDNN's building blocks without servers: segment row mapping (exact), ownership tables, exchanges."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import partition_rel_error

from deepco.partition import Partitioner, PartitionError
from deepco.planning.bands import check_tables, ownership, receives, sends
from deepco.planning.plan import PlanningError


def test_ownership_is_proportional_disjoint_and_covers_every_level():
    heights = [224, 112, 56, 28, 14, 7]
    weights = [3.0, 1.0, 2.0]
    tables = ownership(weights, heights)
    for h, bands in zip(heights, tables, strict=True):
        assert bands[0][0] == 0 and bands[-1][1] == h
        assert all(b0[1] == b1[0] for b0, b1 in zip(bands, bands[1:], strict=False))  # contiguous, in order
        assert all(b > a for a, b in bands)
        for (a, b), w in zip(bands, weights, strict=True):
            assert abs((b - a) - h * w / sum(weights)) <= 1.0  # rounding only
    assert ownership([1.0, 1.0], [10]) == [[(0, 5), (5, 10)]]


def test_ownership_gives_every_server_a_row_and_refuses_too_few_rows():
    (bands,) = ownership([100.0, 1.0, 1.0], [4])
    assert [b - a for a, b in bands] == [2, 1, 1]
    (bands,) = ownership([1.0, 1.0, 100.0], [3])
    assert bands == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(PlanningError, match="cannot give each of 3 servers a row"):
        ownership([1.0, 1.0, 1.0], [2])
    with pytest.raises(PlanningError, match="positive capacities"):
        ownership([1.0, 0.0], [8])


def test_check_tables_refuses_gaps_overlaps_and_windows_outside_the_level():
    bands = [[(0, 4), (4, 8)], [(0, 2), (2, 4)]]
    windows = [[], [(0, 5), (3, 8)]]
    check_tables(bands, windows, [8, 4])
    with pytest.raises(PlanningError, match="band 1"):
        check_tables([[(0, 4), (5, 8)], bands[1]], windows, [8, 4])
    with pytest.raises(PlanningError, match="window 1"):
        check_tables(bands, [[], [(0, 5), (3, 9)]], [8, 4])
    with pytest.raises(PlanningError, match="cover"):
        check_tables(bands, windows, [8, 5])


def test_sends_and_receives_mirror_each_other():
    bands = [[(0, 3), (3, 5), (5, 10)], [(0, 2), (2, 3), (3, 5)]]
    windows = [[], [(0, 6), (2, 9), (4, 10)]]  # server 1's window spans all three bands
    assert receives(bands, windows, 0, 1) == {0: (2, 3), 2: (5, 9)}
    for s in range(3):
        for r, rows in sends(bands, windows, 0, s).items():
            assert receives(bands, windows, 0, r)[s] == rows


def _levels(model, part, cut, image, run):
    """The head's levels computed whole: level 0 the image, then every segment on the previous level."""
    levels = [image]
    for seg in part.segments(cut):
        levels.append(run(seg.model, {seg.model.graph.input[0].name: levels[-1]})[0])
    return levels


@pytest.mark.parametrize(("name", "h", "w", "cut", "servers"), [
    ("resnet18", 97, 131, "layer3", 3),  # deep levels of 7 rows: halos reach past a neighbour's band
    ("resnet18", 128, 160, "layer2", 2),
    ("efficientnet-lite0", 224, 224, "_blocks.5", 3),
])
def test_segments_on_owned_bands_with_exchanged_rows_equal_the_head(partition_zoo, partition_ort, name, h, w, cut,
                                                                     servers):
    model, _ = partition_zoo(name, h, w)
    part = Partitioner(model, h, w)
    segs = part.segments(cut)
    assert segs[-1].target == part.cut(cut).tensor and segs[0].source == part.graph.input_name
    assert [s.in_height for s in segs[1:]] == [s.height for s in segs[:-1]]
    image = np.random.default_rng(3).standard_normal((1, 3, h, w)).astype(np.float32)
    head, _ = part.split(cut)
    (want,) = partition_ort(head, {head.graph.input[0].name: image})
    weights = [2.0, 1.0, 1.5][:servers]
    bands = ownership(weights, [h] + [s.height for s in segs])
    windows = [[]] + [[s.window(*bands[j][i]).input_rows for i in range(servers)] for j, s in enumerate(segs, 1)]
    check_tables(bands, windows, [h] + [s.height for s in segs])
    held = [image[:, :, a:b] for a, b in bands[0]]  # each server holds only its own band
    many_owners = False
    for j, seg in enumerate(segs, start=1):
        nxt = []
        for i in range(servers):
            lo, hi = windows[j][i]
            parts = {}
            own = bands[j - 1][i]
            if max(lo, own[0]) < min(hi, own[1]):
                parts[max(lo, own[0])] = held[i][:, :, max(lo, own[0]) - own[0]:min(hi, own[1]) - own[0]]
            incoming = receives(bands, windows, j - 1, i)
            many_owners |= len(incoming) + (max(lo, own[0]) < min(hi, own[1])) > 2
            for s, (a, b) in incoming.items():
                assert sends(bands, windows, j - 1, s)[i] == (a, b)
                parts[a] = held[s][:, :, a - bands[j - 1][s][0]:b - bands[j - 1][s][0]]
            window = np.concatenate([parts[k] for k in sorted(parts)], axis=2)
            assert window.shape[2] == hi - lo
            (y,) = partition_ort(seg.model, {seg.model.graph.input[0].name: window})
            c0, c1 = seg.crop(*bands[j][i])
            assert c1 - c0 == bands[j][i][1] - bands[j][i][0] and c1 <= y.shape[2]
            nxt.append(y[:, :, c0:c1])
        held = nxt
    got = np.concatenate(held, axis=2)
    assert got.shape == want.shape
    assert partition_rel_error(got, want) <= 1e-4
    if name == "resnet18" and cut == "layer3":
        assert many_owners  # the general case was exercised: some window spans more than two bands


def test_segment_windows_are_checked():
    from deepco import zoo

    part = Partitioner(zoo.export("resnet18", 64, 64), 64, 64)
    seg = part.segments("layer1", models=False)[0]
    with pytest.raises(PartitionError, match="not a non-empty part"):
        seg.window(5, 5)
    w = seg.window(0, seg.height)
    assert w.input_rows == (0, seg.in_height) and w.crop == (0, seg.height) and w.flops > 0


def test_mailboxes_bound_jobs_and_bytes_and_forget_finished_jobs():
    from deepco_server.errors import Kind, ServerFault
    from deepco_server.split_jobs import Mailboxes

    boxes = Mailboxes(max_jobs=1, max_mailboxes=2, max_bytes=64)
    rows = np.zeros((1, 1, 2, 4), np.float32)  # 32 bytes
    boxes.deliver("early", 0, 1, rows, 0)  # a peer's rows may come before the job starts here
    boxes.claim("early")
    with pytest.raises(ServerFault) as info:
        boxes.claim("other")
    assert info.value.kind is Kind.RESOURCE_EXHAUSTED and "1 split jobs already running" in str(info.value)
    with pytest.raises(ServerFault) as info:
        boxes.deliver("early", 0, 1, rows, 0)
    assert info.value.kind is Kind.INVALID_ARGUMENT and "sent twice" in str(info.value)
    boxes.deliver("early", 1, 1, rows, 0)
    with pytest.raises(ServerFault) as info:
        boxes.deliver("early", 2, 1, rows, 0)  # 96 bytes > 64
    assert info.value.kind is Kind.RESOURCE_EXHAUSTED
    got = boxes.take("early", 0, 1, timeout=0.01)
    assert got is not None and got[1] == 0 and boxes.bytes == 32
    assert boxes.take("early", 5, 1, timeout=0.01) is None  # never sent: the caller's deadline decides
    boxes.drop("early")
    assert boxes.bytes == 0 and not boxes.boxes
    boxes.deliver("early", 3, 1, rows, 0)  # late rows of a finished job are dropped
    assert not boxes.boxes
    with pytest.raises(ServerFault) as info:
        boxes.claim("early")
    assert info.value.kind is Kind.ALREADY_EXISTS
    boxes.deliver("a", 0, 0, rows, 0)
    boxes.deliver("b", 0, 0, rows, 0)
    with pytest.raises(ServerFault) as info:
        boxes.deliver("c", 0, 0, rows, 0)
    assert info.value.kind is Kind.RESOURCE_EXHAUSTED and "mailboxes" in str(info.value)


def test_mailboxes_admit_jobs_only_while_their_threads_fit():
    from deepco_server.errors import Kind, ServerFault
    from deepco_server.split_jobs import Mailboxes

    boxes = Mailboxes(max_jobs=4, threads=6)
    boxes.claim("a", 3)
    boxes.claim("b", 3)
    with pytest.raises(ServerFault) as info:
        boxes.claim("c", 1)
    assert info.value.kind is Kind.RESOURCE_EXHAUSTED and "hold 6 of 6" in str(info.value)
    boxes.drop("a")
    boxes.claim("c", 3)
    with pytest.raises(ServerFault) as info:
        Mailboxes(threads=6).claim("huge", 7)
    assert "--max-inflight" in str(info.value)
