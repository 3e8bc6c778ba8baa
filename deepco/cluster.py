"""The one cluster model: the device and its antennas, the servers, and the sites they sit in.

Loaded from a TOML file (see ``examples/`` and the README). Both the inference planner
(``deepco.planning``) and the training scheduler (``deepco.scheduling``) read it, so a server carries
what each needs: a compute capacity for inference planning, and resources, slots and a site for
training jobs. Every validation error names the file, the key and the problem.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepco.errors import UserError

SITE_KINDS = ("edge", "cloud")


class ClusterError(UserError):
    """A cluster description is missing a key or holds an invalid value."""


@dataclass(frozen=True)
class Antenna:
    """One antenna of the device; each antenna sends to its servers one after another."""

    name: str
    bandwidth: float  # data units per time unit (the same units as workload.data_size)


@dataclass(frozen=True)
class Workload:
    """The paper's abstract CNN workload (Table I of the CONVENE paper)."""

    data_size: float  # s: size of one input image
    work: float  # w: computing overhead of one image (in the units of server capacity x time)
    prefetch_ratio: float  # r_o: halo data per block, as a fraction of the image
    layers: int  # |M|: convolutional layers, i.e. MoDNN's exchanges per frame
    exchange_time: float  # MoDNN: time of one boundary exchange between neighbouring servers


@dataclass(frozen=True)
class Resources:
    """What a server offers to training jobs (deepco.scheduling)."""

    gpus: int = 0
    cpus: float = 0.0
    memory_gb: float = 0.0
    worker_slots: int = 0
    ps_slots: int = 0


@dataclass(frozen=True)
class Server:
    """A server near the device."""

    name: str
    capacity: float  # raw capacity c^(i), work per time unit
    address: str | None = None  # host:port of its `deepco serve`
    # where a server has a different address on each antenna of the device (the emulated testbed): one
    # host:port per antenna, in antenna order; `address_on` picks it
    antenna_addresses: tuple[str, ...] = ()
    site: str | None = None
    resources: Resources = field(default_factory=Resources)
    worker_type: str | None = None  # type u of its worker slots (None: serves any job's worker type)
    ps_type: str | None = None  # type v of its PS slots (None: serves any job's PS type)


@dataclass(frozen=True)
class Site:
    """A place servers live in: an edge site near the data, or the cloud (unbounded, far away)."""

    name: str
    kind: str = "edge"
    upload_delay: float = 0.0  # time to move a job's data to this site before it may start
    # when set, each job's delay to this site is drawn in [upload_delay, upload_delay_max] (the seeds' ranges)
    upload_delay_max: float | None = None


@dataclass(frozen=True)
class Link:
    """A network link between two sites, with its bandwidth and unit transfer cost."""

    a: str
    b: str
    bandwidth: float
    cost: float = 0.0


@dataclass(frozen=True)
class Device:
    """The smart device: its antennas and (optionally) its own compute capacity."""

    antennas: tuple[Antenna, ...]
    capacity: float | None = None


@dataclass(frozen=True)
class Cluster:
    """The whole cluster description."""

    device: Device
    servers: tuple[Server, ...]
    workload: Workload | None = None
    sites: tuple[Site, ...] = ()
    links: tuple[Link, ...] = ()
    source: str = "<memory>"

    def address_on(self, server: Server, antenna: int) -> str:
        """The host:port the device reaches ``server`` at over antenna ``antenna``."""
        if server.antenna_addresses:
            return server.antenna_addresses[antenna]
        if server.address is None:
            raise ClusterError(f"{self.source}: key 'servers.{server.name}.address': missing (needed to run)")
        return server.address

    def normalised_capacities(self) -> list[float]:
        """c(i) = c^(i) * s / w (footnote iv of the paper): capacity in data units per time unit."""
        wl = self.require_workload()
        return [srv.capacity * wl.data_size / wl.work for srv in self.servers]

    def require_workload(self) -> Workload:
        """The [workload] table, or a ClusterError if the file has none."""
        if self.workload is None:
            raise ClusterError(f"{self.source}: key 'workload': missing (the abstract planner needs it)")
        return self.workload

    def site(self, name: str) -> Site:
        """The site called ``name``."""
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(name)


class _Table:
    """Reads typed values from one TOML table, naming file and key in every error."""

    def __init__(self, data: Any, where: str, source: str):
        if not isinstance(data, dict):
            raise ClusterError(f"{source}: key '{where}': must be a table")
        self.data, self.where, self.source = data, where, source

    def _key(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, problem: str) -> ClusterError:
        return ClusterError(f"{self.source}: key '{self._key(key)}': {problem}")

    def has(self, key: str) -> bool:
        return key in self.data

    def number(self, key: str, default: float | None = None, *, positive: bool = False,
               minimum: float | None = None, maximum: float | None = None) -> float:
        if key not in self.data:
            if default is None:
                raise self.fail(key, "missing")
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, got {value!r}")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise self.fail(key, f"must be finite, got {value}")
        if positive and value <= 0:
            raise self.fail(key, f"must be positive, got {value:g}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum:g}, got {value:g}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be <= {maximum:g}, got {value:g}")
        return value

    def integer(self, key: str, default: int | None = None, *, minimum: int = 0) -> int:
        if key not in self.data:
            if default is None:
                raise self.fail(key, "missing")
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        return value

    def string(self, key: str, default: str | None = None, *, required: bool = True) -> str | None:
        if key not in self.data:
            if default is None and required:
                raise self.fail(key, "missing")
            return default
        value = self.data[key]
        if not isinstance(value, str) or not value.strip():
            raise self.fail(key, f"must be a non-empty string, got {value!r}")
        return value

    def tables(self, key: str) -> list[_Table]:
        value = self.data.get(key, [])
        if not isinstance(value, list):
            raise self.fail(key, "must be an array of tables ([[...]])")
        return [_Table(item, f"{self._key(key)}[{i}]", self.source) for i, item in enumerate(value)]

    def table(self, key: str) -> _Table | None:
        if key not in self.data:
            return None
        return _Table(self.data[key], self._key(key), self.source)

    def reject_unknown(self, known: set[str]) -> None:
        for key in self.data:
            if key not in known:
                raise self.fail(key, f"unknown key (known: {', '.join(sorted(known))})")


def _parse_address(t: _Table) -> str | None:
    address = t.string("address", required=False)
    if address is None:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise t.fail("address", f"must be host:port with a port in 1..65535, got {address!r}")
    return address


def _parse_antenna_addresses(t: _Table) -> tuple[str, ...]:
    value = t.data.get("antenna_addresses", [])
    if not isinstance(value, list):
        raise t.fail("antenna_addresses", "must be a list of host:port strings, one per antenna")
    out = []
    for i, item in enumerate(value):
        address = _parse_address(_Table({"address": item}, f"{t.where}.antenna_addresses[{i}]", t.source))
        out.append(address or "")
    return tuple(out)


def _parse_device(root: _Table) -> Device:
    dev = root.table("device")
    if dev is None:
        raise root.fail("device", "missing")
    dev.reject_unknown({"antennas", "bandwidth", "antenna", "capacity"})
    listed = dev.tables("antenna")
    if listed:
        if dev.has("antennas") or dev.has("bandwidth"):
            raise dev.fail("antenna", "give either antennas + bandwidth or [[device.antenna]] tables, not both")
        antennas = []
        for i, t in enumerate(listed):
            t.reject_unknown({"name", "bandwidth"})
            antennas.append(Antenna(name=t.string("name", f"a{i}") or f"a{i}",
                                    bandwidth=t.number("bandwidth", positive=True)))
    else:
        count = dev.integer("antennas", minimum=1)
        bandwidth = dev.number("bandwidth", positive=True)
        antennas = [Antenna(name=f"a{i}", bandwidth=bandwidth) for i in range(count)]
    names = [a.name for a in antennas]
    if len(set(names)) != len(names):
        raise dev.fail("antenna", f"antenna names must be unique, got {names}")
    capacity = dev.number("capacity", positive=True) if dev.has("capacity") else None
    return Device(antennas=tuple(antennas), capacity=capacity)


def _parse_workload(root: _Table) -> Workload | None:
    wl = root.table("workload")
    if wl is None:
        return None
    wl.reject_unknown({"data_size", "work", "prefetch_ratio", "layers", "exchange_time"})
    return Workload(
        data_size=wl.number("data_size", positive=True),
        work=wl.number("work", positive=True),
        prefetch_ratio=wl.number("prefetch_ratio", minimum=0.0, maximum=1.0),
        layers=wl.integer("layers", 1, minimum=0),
        exchange_time=wl.number("exchange_time", 0.0, minimum=0.0),
    )


def _parse_servers(root: _Table) -> tuple[Server, ...]:
    tables = root.tables("servers")
    if not tables:
        raise root.fail("servers", "missing: at least one [[servers]] table is needed")
    servers = []
    for t in tables:
        t.reject_unknown({"name", "capacity", "address", "antenna_addresses", "site", "gpus", "cpus", "memory_gb",
                          "worker_slots", "ps_slots", "worker_type", "ps_type"})
        servers.append(Server(
            name=t.string("name") or "",
            capacity=t.number("capacity", positive=True),
            address=_parse_address(t),
            antenna_addresses=_parse_antenna_addresses(t),
            site=t.string("site", required=False),
            resources=Resources(
                gpus=t.integer("gpus", 0),
                cpus=t.number("cpus", 0.0, minimum=0.0),
                memory_gb=t.number("memory_gb", 0.0, minimum=0.0),
                worker_slots=t.integer("worker_slots", 0),
                ps_slots=t.integer("ps_slots", 0),
            ),
            worker_type=t.string("worker_type", required=False),
            ps_type=t.string("ps_type", required=False),
        ))
    names = [s.name for s in servers]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise root.fail("servers", f"server names must be unique, repeated: {', '.join(dupes)}")
    return tuple(servers)


def _parse_sites(root: _Table, servers: tuple[Server, ...]) -> tuple[tuple[Site, ...], tuple[Link, ...]]:
    sites = []
    for t in root.tables("sites"):
        t.reject_unknown({"name", "kind", "upload_delay", "upload_delay_max"})
        kind = t.string("kind", "edge") or "edge"
        if kind not in SITE_KINDS:
            raise t.fail("kind", f"must be one of {', '.join(SITE_KINDS)}, got {kind!r}")
        delay = t.number("upload_delay", 0.0, minimum=0.0)
        delay_max = t.number("upload_delay_max", minimum=delay) if t.has("upload_delay_max") else None
        sites.append(Site(name=t.string("name") or "", kind=kind, upload_delay=delay,
                          upload_delay_max=delay_max))
    site_names = {s.name for s in sites}
    if len(site_names) != len(sites):
        raise root.fail("sites", "site names must be unique")
    for i, srv in enumerate(servers):
        if srv.site is not None and srv.site not in site_names:
            raise root.fail(f"servers[{i}].site", f"unknown site {srv.site!r} (define it in [[sites]])")
    links = []
    for t in root.tables("links"):
        t.reject_unknown({"from", "to", "bandwidth", "cost"})
        a, b = t.string("from") or "", t.string("to") or ""
        for key, name in (("from", a), ("to", b)):
            if name not in site_names:
                raise t.fail(key, f"unknown site {name!r}")
        links.append(Link(a=a, b=b, bandwidth=t.number("bandwidth", positive=True),
                          cost=t.number("cost", 0.0, minimum=0.0)))
    return tuple(sites), tuple(links)


def parse_cluster(data: dict[str, Any], source: str = "<memory>", *, require_device: bool = True) -> Cluster:
    """Build a Cluster from already-parsed TOML data; ``source`` names it in errors. ``require_device=False``
    (the training scheduler) lets ``[device]`` be left out: the cluster then has a device with no antennas."""
    root = _Table(data, "", source)
    root.reject_unknown({"device", "workload", "servers", "sites", "links"})
    servers = _parse_servers(root)
    sites, links = _parse_sites(root, servers)
    device = _parse_device(root) if require_device or root.has("device") else Device(antennas=())
    for i, srv in enumerate(servers):
        if srv.antenna_addresses and len(srv.antenna_addresses) != len(device.antennas):
            raise root.fail(f"servers[{i}].antenna_addresses", f"has {len(srv.antenna_addresses)} addresses "
                            f"for {len(device.antennas)} antennas")
    return Cluster(device=device, servers=servers, workload=_parse_workload(root),
                   sites=sites, links=links, source=source)


def load_cluster(path: str | Path, *, require_device: bool = True) -> Cluster:
    """Load and validate a cluster TOML file (``require_device``: see ``parse_cluster``)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ClusterError(f"{path}: no such file") from None
    except OSError as exc:
        raise ClusterError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ClusterError(f"{path}: not a UTF-8 text file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ClusterError(f"{path}: invalid TOML: {exc}") from None
    return parse_cluster(data, str(path), require_device=require_device)
