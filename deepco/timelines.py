"""Where a frame's time goes, from its timeline as the JSON log records it (`deepco run --json-log`'s
``staged`` field; `deepco bench`'s ``timeline``): the servers' own step timelines (``deepco.StepTimes``)
placed on the frame's clock by the device.

- `step_split`: the median of every phase over many frames, and the *per-step overhead*: a step is one
  segment (or the tail) on one server, from the end of the server's previous compute (or its step's start)
  to the end of its own compute, plus the answer's encoding and sending after the last one; its overhead is
  that wall time less its compute (``overhead``), and less also its wait for peers' rows
  (``overhead_less_halo``: what the server itself spends on messages, copies and Python; ``untimed``: the
  part of it in no timed phase).
- `by_level`: per level and server, the median compute and wait for peers' rows: who keeps whom waiting.
- `row_delays`: how long a neighbour's rows took from being queued to ending a wait for them.
- `gantt`: one frame as a Gantt chart, a row per participant and per antenna.

Pure functions on JSON dicts, so a log read back draws the same chart as the run that wrote it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

PHASE_NAMES = ("input", "halo", "queue", "compute", "encode", "send", "assemble")


def frame_steps(staged: dict) -> list[dict]:
    """The server steps of one frame's ``staged`` record (split: one per participant; offload: its server's,
    when the log has it)."""
    return list(staged.get("servers") or [])


def segment_steps(times: dict) -> list[dict]:
    """One server step's timeline (``times`` of a step, with ``phases`` and ``wall``) cut into segment steps:
    each from the previous compute's end (the step's start for the first) to its own compute's end, the last
    also through the answer's encoding and sending (to ``wall``). Each: level, wall, compute, halo, overhead
    (wall less compute), overhead_less_halo, untimed (in no phase: Python, copies, thread hand-overs). Empty
    when the server sent no timeline."""
    phases = times.get("phases") or []
    computes = [p for p in phases if p["phase"] == "compute"]
    if not computes:
        return []
    steps, begin = [], 0.0
    for k, c in enumerate(computes):
        end = c["end"] if k < len(computes) - 1 else max(times.get("wall", 0.0), c["end"])
        inside = [p for p in phases if p["start"] >= begin - 1e-9 and p["end"] <= end + 1e-9]
        halo = sum(p["end"] - p["start"] for p in inside if p["phase"] == "halo")
        compute = c["end"] - c["start"]
        steps.append({"level": c["level"], "wall": end - begin, "compute": compute, "halo": halo,
                      "overhead": end - begin - compute, "overhead_less_halo": end - begin - compute - halo,
                      "untimed": end - begin - sum(p["end"] - p["start"] for p in inside)})
        begin = end
    return steps


def step_split(records: Iterable[dict]) -> dict[str, Any]:
    """The per-step time split of many frames (JSON log lines, or bare ``staged`` dicts): medians of each
    phase per server step (a participant's whole job), of its wall time (server and device views), and of
    the segment steps' wall time, compute and overhead. Frames without server timelines are skipped."""
    jobs: list[dict] = []
    segments: list[dict] = []
    frames = 0
    for record in records:
        staged = record.get("staged", record) if isinstance(record, dict) else None
        if not staged or record.get("error"):
            continue
        steps = [s for s in frame_steps(staged) if (s.get("times") or {}).get("wall")]
        frames += bool(steps)
        for s in steps:
            times = s["times"]
            jobs.append({**{p: times.get(p, 0.0) for p in PHASE_NAMES}, "wall": times["wall"],
                         "device_wall": s["finish"] - s["send_start"]})
            segments.extend(segment_steps(times))

    def median(rows: list[dict], key: str) -> float | None:
        return statistics.median(r[key] for r in rows) if rows else None

    return {"frames": frames, "server_steps": len(jobs), "segment_steps": len(segments),
            "job": {k: median(jobs, k) for k in (*PHASE_NAMES, "wall", "device_wall")},
            "segment": {k: median(segments, k) for k in ("wall", "compute", "halo", "overhead",
                                                         "overhead_less_halo", "untimed")}}


def split_text(split: dict) -> str:
    """`step_split`'s figures as a few lines (milliseconds)."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.2f}"

    job, seg = split["job"], split["segment"]
    return "\n".join([
        f"{split['frames']} frames, {split['server_steps']} server steps, {split['segment_steps']} segment steps "
        "(medians, ms)",
        "server step: " + "  ".join(f"{p} {ms(job[p])}" for p in PHASE_NAMES)
        + f"  wall {ms(job['wall'])} (device saw {ms(job['device_wall'])})",
        f"segment step: wall {ms(seg['wall'])}  compute {ms(seg['compute'])}  halo {ms(seg['halo'])}  "
        f"overhead {ms(seg['overhead'])} (less halo {ms(seg['overhead_less_halo'])}; in no phase: "
        f"{ms(seg['untimed'])})"])


def by_level(records: Iterable[dict]) -> dict[str, dict[int, dict[str, float]]]:
    """Per server, per level of its timeline: the median over frames of its compute and of its wait for peers'
    rows there (seconds). A server that computes longest at a level while its neighbours wait there is the
    one the others wait for (the split's bands are not in proportion to the servers' speeds)."""
    seen: dict[str, dict[int, dict[str, list[float]]]] = {}
    for record in records:
        staged = record.get("staged", record) if isinstance(record, dict) else None
        if not staged or record.get("error"):
            continue
        for step in frame_steps(staged):
            frame: dict[int, dict[str, float]] = {}
            for phase in (step.get("times") or {}).get("phases") or []:
                if phase["phase"] in ("compute", "halo"):
                    level = frame.setdefault(phase["level"], {"compute": 0.0, "halo": 0.0})
                    level[phase["phase"]] += phase["end"] - phase["start"]
            for level, spent in frame.items():
                lists = seen.setdefault(step["name"], {}).setdefault(level, {"compute": [], "halo": []})
                for key in ("compute", "halo"):
                    lists[key].append(spent[key])
    return {name: {level: {k: statistics.median(v) for k, v in lists.items()}
                   for level, lists in sorted(levels.items())}
            for name, levels in sorted(seen.items())}


def row_delays(records: Iterable[dict], least: float = 0.002) -> list[float]:
    """For every wait of a server for its neighbours' rows longer than ``least`` seconds after the first level:
    how long after the later of its two neighbours (in band order) had queued their rows of that level for
    gRPC the wait ended (seconds, on the frame's clock). Long waits of short delays: the neighbours computed
    late; long delays: the rows were slow to cross (gRPC's threads, the sender's or receiver's CPU quota)."""
    delays: list[float] = []
    for record in records:
        staged = record.get("staged", record) if isinstance(record, dict) else None
        if not staged or record.get("error"):
            continue
        steps = sorted((s for s in frame_steps(staged) if (s.get("times") or {}).get("phases")),
                       key=lambda s: (s.get("rows") or [0])[0])
        phases = [[(p["phase"], p["level"], s.get("origin", 0.0) + p["start"], s.get("origin", 0.0) + p["end"])
                   for p in s["times"]["phases"]] for s in steps]
        for k, mine in enumerate(phases):
            for what, level, start, end in mine:
                if what != "halo" or level < 2 or end - start <= least:
                    continue
                queued = [min(e for w, lv, _, e in phases[m] if w == "send" and lv == level)
                          for m in (k - 1, k + 1) if 0 <= m < len(phases)
                          and any(w == "send" and lv == level for w, lv, _, _ in phases[m])]
                if queued:
                    delays.append(end - max(queued))
    return delays


def by_level_text(table: dict[str, dict[int, dict[str, float]]]) -> str:
    """`by_level` as a table (ms, compute / wait for peers' rows), and what the slowest server of each level
    costs: the sum over levels of its compute against the sum of the servers' mean compute."""
    names = list(table)
    levels = sorted({level for per in table.values() for level in per})
    lines = ["level  " + "  ".join(f"{n + ' compute/wait':>20}" for n in names)]
    slowest = mean = 0.0
    for level in levels:
        cells = [table[n].get(level) for n in names]
        lines.append(f"{level:5d}  " + "  ".join(
            f"{c['compute'] * 1e3:9.1f}/{c['halo'] * 1e3:<10.1f}" if c else f"{'-':>20}" for c in cells))
        computes = [c["compute"] for c in cells if c]
        slowest, mean = slowest + max(computes), mean + statistics.fmean(computes)
    lines.append(f"the slowest server's compute, summed over levels: {slowest * 1e3:.1f} ms; the servers' mean: "
                 f"{mean * 1e3:.1f} ms")
    return "\n".join(lines)


# What each bar means, and its colour: receive (the input's transfer and decoding), compute, exchange
# (waiting for peers' rows; encoding and sending rows), copying rows into a run's window or a band, queue, the
# answer's return; idle is the background.
LEGEND = {"receive": "#4c72b0", "compute": "#55a868", "exchange wait": "#c44e52", "exchange send": "#dd8452",
          "copy": "#da8bc3", "queue": "#8172b2", "return": "#937860", "device": "#64b5cd"}
_BAR = {"input": "receive", "halo": "exchange wait", "queue": "queue", "compute": "compute",
        "encode": "exchange send", "send": "exchange send", "assemble": "copy"}


def gantt_bars(staged: dict) -> dict[str, list[tuple[str, float, float]]]:
    """The bars of one frame (``staged``: its record's ``staged`` field), per row label: (what, start, end)
    in seconds from the frame's start. Rows: each participant (``name (antenna m)``) and each antenna."""
    rows: dict[str, list[tuple[str, float, float]]] = {}
    antennas: dict[str, list[tuple[str, float, float]]] = {}
    for s in frame_steps(staged):
        times, origin = s.get("times") or {}, s.get("origin", 0.0)
        bars = rows.setdefault(f"{s['name']} (antenna {s['antenna']})", [])
        if origin > s["send_start"]:
            bars.append(("receive", s["send_start"], origin))
        bars.extend((_BAR[p["phase"]], origin + p["start"], origin + p["end"]) for p in times.get("phases", []))
        end = origin + times.get("wall", 0.0)
        if times.get("wall") and s["finish"] > end:
            bars.append(("return", end, s["finish"]))
        if s.get("received", 0.0) > s["send_start"]:
            antennas.setdefault(f"antenna {s['antenna']}", []).append(("receive", s["send_start"], s["received"]))
    device = [("device", 0.0, staged.get("sent", 0.0))]
    if staged.get("tail") or staged.get("stitch"):
        device.append(("device", staged.get("collected", 0.0), staged.get("latency", 0.0)))
    return {"device": device, **dict(sorted(antennas.items())), **rows}


def gantt(staged: dict, path: str, title: str = "") -> None:
    """Draw one frame (``staged``) as a Gantt chart into ``path`` (PNG): a row per participant and antenna,
    receive / compute / exchange / queue / return bars, idle left blank. UserError when it cannot be written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from deepco.plots import save_figure

    rows = gantt_bars(staged)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(rows)))
    labels = list(rows)[::-1]
    for y, label in enumerate(labels):
        ax.broken_barh([(0.0, staged.get("latency", 0.0) * 1e3)], (y - 0.4, 0.8), facecolors="#eeeeee")
        for what, a, b in rows[label]:
            ax.broken_barh([(a * 1e3, max(b - a, 0.0) * 1e3)], (y - 0.35, 0.7), facecolors=LEGEND[what])
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("ms from the frame's start")
    ax.set_xlim(0, max(staged.get("latency", 0.0) * 1e3, 1e-3))
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in LEGEND.items()]
    handles.append(matplotlib.patches.Patch(color="#eeeeee", label="idle"))
    fig.legend(handles=handles, fontsize=7, ncol=len(handles), loc="lower center")
    ax.set_title(title or f"one frame: {staged.get('latency', 0.0) * 1e3:.1f} ms", fontsize=9)
    height = fig.get_size_inches()[1]
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))  # room for the legend under the axis' label
    save_figure(fig, path)
