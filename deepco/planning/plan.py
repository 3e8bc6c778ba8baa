"""Plans are data: what each selected server receives, when, and when it finishes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from deepco.cluster import Cluster
from deepco.errors import UserError


class PlanningError(UserError):
    """The instance cannot be planned (too large for `optimal`, no feasible selection, ...)."""


@dataclass(frozen=True)
class Instance:
    """A CONVENE instance in the paper's normalised units.

    ``capacities`` are normalised, c(i) = c^(i) s / w; ``bandwidths`` are per antenna.
    """

    names: tuple[str, ...]
    capacities: tuple[float, ...]
    antenna_names: tuple[str, ...]
    bandwidths: tuple[float, ...]
    data_size: float
    prefetch_ratio: float
    layers: int = 0
    exchange_time: float = 0.0

    @classmethod
    def from_cluster(cls, cluster: Cluster) -> Instance:
        """The abstract instance of a cluster file's [device], [workload] and [[servers]]."""
        wl = cluster.require_workload()
        return cls(
            names=tuple(s.name for s in cluster.servers),
            capacities=tuple(cluster.normalised_capacities()),
            antenna_names=tuple(a.name for a in cluster.device.antennas),
            bandwidths=tuple(a.bandwidth for a in cluster.device.antennas),
            data_size=wl.data_size,
            prefetch_ratio=wl.prefetch_ratio,
            layers=wl.layers,
            exchange_time=wl.exchange_time,
        )

    def by_capacity(self) -> list[int]:
        """Server indices, strongest first; ties keep file order so plans are deterministic."""
        return sorted(range(len(self.capacities)), key=lambda i: (-self.capacities[i], i))


@dataclass
class Assignment:
    """One selected server's part of a plan (times from the start of the frame)."""

    name: str
    antenna: str
    order: int  # position in its antenna's transfer sequence, from 0
    ratio: float  # r_i: share of the image's rows this server is responsible for
    transfer_start: float
    transfer_time: float
    compute_start: float
    compute_time: float
    exchange_time: float  # MoDNN's boundary exchanges; 0 for data-lookahead plans
    finish_time: float


@dataclass
class Plan:
    """A complete plan: the selected servers only, listed antenna by antenna in transfer order."""

    algorithm: str
    completion_time: float
    servers: list[Assignment] = field(default_factory=list)
    halo_ratio: float = 0.0  # the prefetched-data ratio each block carried in this plan

    def to_dict(self) -> dict:
        """The JSON form printed by `deepco plan --json`."""
        return {"algorithm": self.algorithm, "completion_time": self.completion_time,
                "halo_ratio": self.halo_ratio, "servers": [asdict(a) for a in self.servers]}
