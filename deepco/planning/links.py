"""Each antenna's rate as live frames carried the image, not as setup's probe measured it.

Setup probes an antenna once, with one large message. A frame's windows cross it otherwise: two sender
threads on a device of a tenth of a core, each antenna's messages one after another. On the camera preset
(ResNet-18 at 720x1280, four servers on two 100 Mbit/s antennas) the windows of the second server on each
antenna arrived 20-45 ms after the model said, and once a probe read one antenna at 5.2 MB/s where frames
crossed it at about 12: the first stage, sized to the predicted arrivals (`deepco.planning.staged.refine`),
left the late servers computing 30-60 ms after the others, and every server waited for them at the next
exchange. A split frame's runner measures when each server had its whole window (``ServerStep.received``:
the server's acknowledgement); `Links` keeps those arrivals, and `factors` fits, per antenna, the factor its
probed time is multiplied by so that the send model (`deepco.planning.staged.sends`) meets them in the least
squares. `with_links` plans on it.

Only frames of plans that send windows count (splits, plans across scales): an offload's runner does not
see its input arrive. Windows streamed in sub-bands do not count towards the antennas: the rest of one is
acknowledged by a server that is computing its first sub-band on the same CPU quota, so its "received" is when
that server found the CPU to take it, not when the antenna alone would have delivered it (on the camera preset
a fit over such windows read the antennas 2.2-2.7x slower than the probe; over whole windows, in another run,
1.1-1.3x). That slowness is real, though, and the model has to see it: on the same preset the rests arrived
at 320-330 ms where the same plan's windows sent whole arrived by 200 ms, the last server finished its first
stage 40 ms later and the frame took about 50 ms longer, while the model, which sent the rests at the
antenna's rate, predicted the streamed plan the faster. So the streamed windows' arrivals fit a factor of their
own, ``REST`` among the antennas' (`Rates.rest_slowdown`: how many times longer a rest holds its antenna than
its bytes alone take), once the antennas' are fitted on the whole windows.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from deepco.planning.staged import DEVICE, CostModel, Rates, StagedPlan, sends, streamed

LINK_BOUNDS = (0.25, 4.0)  # an antenna within 4x of its probe, either way (and a rest within 4x of its bytes)
REST = -1  # the key of the streamed windows' rests' factor (`Rates.rest_slowdown`) among the antennas' factors
STEPS = 160  # factors tried per antenna, geometric between the bounds (about 1.8% apart)
PASSES = 2  # the antennas share the device's CPU in the model: a second pass fits each to the other's fit


def with_links(rates: Rates, factors: dict[int, float]) -> Rates:
    """``rates`` with antenna ``m``'s bytes per second divided by its factor in ``factors`` (`Links.factors`;
    1 where it has none) and the rests' slowdown its ``REST`` factor (where it has one)."""
    if not factors:
        return rates
    return replace(rates, antenna_bytes_per_second=[bw / factors.get(m, 1.0)
                                                    for m, bw in enumerate(rates.antenna_bytes_per_second)],
                   rest_slowdown=factors.get(REST, rates.rest_slowdown))


class Links:
    """The windows' measured arrivals (see the module doc) and the per-antenna factors they fit."""

    def __init__(self, costs: CostModel, measured: Rates):
        self.costs, self.measured = costs, measured
        # per plan: the arrivals of each server's window sent whole, and of each streamed one's rest
        self._frames: dict[str, tuple[StagedPlan, dict[str, list[float]], dict[str, list[float]]]] = {}
        self._fit: dict[int, float] | None = None

    def add(self, plan: StagedPlan, arrivals: dict[str, float]) -> None:
        """One frame of ``plan``: ``arrivals``, seconds from the frame's start until each server had its whole
        window (for a window streamed in sub-bands: its rest)."""
        if plan.kind not in ("split", "scales"):
            return
        is_streamed = {s: r is not None for s, r in zip(plan.servers, streamed(plan), strict=True) if s != DEVICE}
        key = repr((plan.servers, plan.antennas, plan.order, plan.windows[:1], plan.overlap[1:2]))
        _, whole, rest = self._frames.setdefault(key, (plan, {}, {}))
        for name, seconds in arrivals.items():
            if name in is_streamed and seconds > 0:
                (rest if is_streamed[name] else whole).setdefault(name, []).append(seconds)
                self._fit = None

    def factors(self) -> dict[int, float]:
        """Per antenna that carried a window sent whole, the factor on its probed time that fits the medians of
        those windows' arrivals best (squared relative error); then, where windows were streamed, the factor
        of their rests (``REST``) that fits theirs on those antennas; each within ``LINK_BOUNDS``; none until a
        frame was seen."""
        if self._fit is None:
            self._fit = self._fitted()
        return dict(self._fit)

    def _fitted(self) -> dict[int, float]:
        medians = [(plan, {s: statistics.median(v) for s, v in whole.items()},
                    {s: statistics.median(v) for s, v in rests.items()})
                   for plan, whole, rests in self._frames.values()]
        used = sorted({plan.antennas[i] for plan, whole, _ in medians for i, s in enumerate(plan.servers)
                       if s in whole})
        low, high = LINK_BOUNDS
        grid = [low * (high / low) ** (k / (STEPS - 1)) for k in range(STEPS)]
        fit = dict.fromkeys(used, 1.0)

        def error(factors: dict[int, float], m: int) -> float:
            rates = with_links(self.measured, factors)
            total = 0.0
            for plan, whole, rests in medians:
                arrived = sends(plan, self.costs, rates)[1]
                seen = rests if m == REST else whole
                total += sum((arrived[i] / seen[s] - 1) ** 2 for i, s in enumerate(plan.servers)
                             if s in seen and (m == REST or plan.antennas[i] == m))
            return total

        for _ in range(PASSES):
            for m in used:
                fit[m] = min(grid, key=lambda k: (error(fit | {m: k}, m), abs(math.log(k))))
        if any(rests for _, _, rests in medians):  # the antennas as fitted, and the rests on top
            fit[REST] = min(grid, key=lambda k: (error(fit | {REST: k}, REST), abs(math.log(k))))
        return fit
