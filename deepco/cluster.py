"""The one cluster model: the device and its antennas, the servers, and the sites they sit in.

Loaded from a TOML file (see ``examples/`` and docs/usage.md). Both the inference planner
(``deepco.planning``) and the training scheduler (``deepco.scheduling``) read it, so a server carries
what each needs: a compute capacity for inference planning, and resources, slots and a site for
training jobs. Every validation error names the file, the key and the problem; every missing key of a
file is reported in one error.

What the device measures itself (each server's speed, each antenna's bandwidth) is optional: a file for
`deepco run` needs nothing but server addresses. The abstract planner, which measures nothing, asks for
them through :meth:`Cluster.require_workload`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepco.errors import UserError
from deepco.parsing import is_address

SITE_KINDS = ("edge", "cloud")
# What a missing key means, and its unit: appended to "missing" errors. Capacities and bandwidths are in
# abstract units for the abstract planner (only their ratios to workload.work and workload.data_size matter).
UNITS = {
    "capacity": "raw compute capacity c^(i): units of workload.work per unit of time",
    "bandwidth": "per antenna: units of workload.data_size per unit of time; Mbit/s for `deepco run --pace`",
    "antennas": "how many antennas the device has",
    "name": "a unique name",
    "address": "host:port of the server's `deepco serve`",
    "data_size": "s: the size of one image, in data units",
    "work": "w: the computing overhead of one image, in work units",
    "prefetch_ratio": "r_o: halo data per block as a fraction of the image, 0..1",
    "workload": "the table data_size, work, prefetch_ratio[, layers, exchange_time]",
    "device": "the table antennas + bandwidth, or [[device.antenna]] tables",
}


class ClusterError(UserError):
    """A cluster description is missing a key or holds an invalid value."""


@dataclass(frozen=True)
class Antenna:
    """One antenna of the device; each antenna sends to its servers one after another."""

    name: str
    # data units per time unit (the same units as workload.data_size); Mbit/s when paced; None: measured
    bandwidth: float | None = None


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
    capacity: float | None = None  # raw capacity c^(i), work per time unit; None: measured by the device
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
    """The smart device: its antennas and (optionally) its own compute capacity.

    A file without a [device] table gets one antenna of unmeasured bandwidth (``declared`` False).
    """

    antennas: tuple[Antenna, ...]
    capacity: float | None = None
    declared: bool = True  # the file has a [device] table


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
        return [srv.capacity * wl.data_size / wl.work for srv in self.servers]  # type: ignore[operator]

    def require_workload(self) -> Workload:
        """The [workload] table, once it is certain the file has everything the abstract planner needs
        (workload, [device], every antenna's bandwidth and every server's capacity); else one ClusterError
        naming every missing key."""
        missing = []
        if not self.device.declared:
            missing.append("device")
        elif all(a.bandwidth is None for a in self.device.antennas):
            missing.append("device.bandwidth")
        else:  # only [[device.antenna]] tables can give some antennas a bandwidth and not others
            missing += [f"device.antenna[{i}].bandwidth" for i, a in enumerate(self.device.antennas)
                        if a.bandwidth is None]
        missing += [f"servers[{i}].capacity" for i, s in enumerate(self.servers) if s.capacity is None]
        if self.workload is None:
            missing.append("workload")
        if missing:
            raise ClusterError(f"{self.source}: {_missing(missing)}; the abstract planner needs them (or "
                               "measure the servers and antennas: deepco plan --model M --input-size HxW)")
        assert self.workload is not None
        return self.workload

    def require_addresses(self) -> None:
        """A ClusterError naming every server the device could not reach (no address, no antenna_addresses)."""
        missing = [f"servers[{i}].address" for i, s in enumerate(self.servers)
                   if s.address is None and not s.antenna_addresses]
        if missing:
            raise ClusterError(f"{self.source}: {_missing(missing)}; the device needs every server's address")

    def require_bandwidths(self, why: str) -> None:
        """A ClusterError unless every antenna has a configured bandwidth (``why`` says who needs it)."""
        if any(a.bandwidth is None for a in self.device.antennas):
            key = "device.bandwidth" if self.device.declared else "device"
            raise ClusterError(f"{self.source}: {_missing([key])}; {why} needs it")

    def site(self, name: str) -> Site:
        """The site called ``name``."""
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(name)


def _missing(keys: list[str]) -> str:
    """'missing key 'a' (its unit), key 'b' (...)': every missing key with what it means."""
    described = [f"'{k}' ({UNITS[k.rsplit('.', 1)[-1]]})" if k.rsplit(".", 1)[-1] in UNITS else f"'{k}'"
                 for k in keys]
    return f"missing key{'s' if len(keys) > 1 else ''} {', '.join(described)}"


class _Table:
    """Reads typed values from one TOML table, naming file and key in every error.

    A missing required key is not raised at once: it is added to ``missing`` (shared by every table of
    one file) and a placeholder is returned, so that the file's loader reports all of them in one error.
    """

    def __init__(self, data: Any, where: str, source: str, missing: list[str] | None = None):
        if not isinstance(data, dict):
            raise ClusterError(f"{source}: key '{where}': must be a table")
        self.data, self.where, self.source = data, where, source
        self.missing = [] if missing is None else missing

    def _key(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, problem: str) -> ClusterError:
        return ClusterError(f"{self.source}: key '{self._key(key)}': {problem}")

    def lack(self, key: str) -> None:
        """Note a missing required key (reported with the others by the loader)."""
        self.missing.append(self._key(key))

    def has(self, key: str) -> bool:
        return key in self.data

    def number(self, key: str, default: float | None = None, *, positive: bool = False,
               minimum: float | None = None, maximum: float | None = None) -> float:
        if key not in self.data:
            if default is None:
                self.lack(key)
                return 1.0  # a placeholder: the loader raises before anyone sees it
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
                self.lack(key)
                return max(minimum, 1)  # a placeholder, as in number()
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
                self.lack(key)
                return f"<missing {self._key(key)}>"  # a placeholder, as in number()
            return default
        value = self.data[key]
        if not isinstance(value, str) or not value.strip():
            raise self.fail(key, f"must be a non-empty string, got {value!r}")
        return value

    def tables(self, key: str) -> list[_Table]:
        value = self.data.get(key, [])
        if not isinstance(value, list):
            raise self.fail(key, "must be an array of tables ([[...]])")
        return [_Table(item, f"{self._key(key)}[{i}]", self.source, self.missing) for i, item in enumerate(value)]

    def table(self, key: str) -> _Table | None:
        if key not in self.data:
            return None
        return _Table(self.data[key], self._key(key), self.source, self.missing)

    def reject_unknown(self, known: set[str]) -> None:
        for key in self.data:
            if key not in known:
                raise self.fail(key, f"unknown key (known: {', '.join(sorted(known))})")


def _parse_address(t: _Table) -> str | None:
    address = t.string("address", required=False)
    if address is None:
        return None
    if not is_address(address):
        raise t.fail("address", f"must be host:port with a port in 1..65535, got {address!r}")
    return address


def _parse_antenna_addresses(t: _Table) -> tuple[str, ...]:
    value = t.data.get("antenna_addresses", [])
    if not isinstance(value, list):
        raise t.fail("antenna_addresses", "must be a list of host:port strings, one per antenna")
    out = []
    for i, item in enumerate(value):
        address = _parse_address(_Table({"address": item}, f"{t.where}.antenna_addresses[{i}]", t.source,
                                        t.missing))
        out.append(address or "")
    return tuple(out)


def _parse_device(root: _Table) -> Device:
    dev = root.table("device")
    if dev is None:  # `deepco run` measures the one antenna it then uses; the abstract planner asks for it
        return Device(antennas=(Antenna(name="a0"),), declared=False)
    dev.reject_unknown({"antennas", "bandwidth", "antenna", "capacity"})
    listed = dev.tables("antenna")
    if listed:
        if dev.has("antennas") or dev.has("bandwidth"):
            raise dev.fail("antenna", "give either antennas + bandwidth or [[device.antenna]] tables, not both")
        antennas = []
        for i, t in enumerate(listed):
            t.reject_unknown({"name", "bandwidth"})
            antennas.append(Antenna(name=t.string("name", f"a{i}") or f"a{i}",
                                    bandwidth=t.number("bandwidth", positive=True) if t.has("bandwidth") else None))
    else:
        count = dev.integer("antennas", 1, minimum=1)
        bandwidth = dev.number("bandwidth", positive=True) if dev.has("bandwidth") else None
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
        address = _parse_address(t)
        servers.append(Server(
            name=t.string("name", address) or "",  # an address-only server is called by its address
            capacity=t.number("capacity", positive=True) if t.has("capacity") else None,
            address=address,
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
    names = [s.name for s in servers if not s.name.startswith("<missing")]
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
    links = []
    for t in root.tables("links"):
        t.reject_unknown({"from", "to", "bandwidth", "cost"})
        links.append((t, Link(a=t.string("from") or "", b=t.string("to") or "",
                              bandwidth=t.number("bandwidth", positive=True), cost=t.number("cost", 0.0, minimum=0.0))))
    if root.missing:  # a missing site name would make every reference to it look wrong: report what is missing
        return (), ()
    for i, srv in enumerate(servers):
        if srv.site is not None and srv.site not in site_names:
            raise root.fail(f"servers[{i}].site", f"unknown site {srv.site!r} (define it in [[sites]])")
    for t, link in links:
        for key, name in (("from", link.a), ("to", link.b)):
            if name not in site_names:
                raise t.fail(key, f"unknown site {name!r}")
    return tuple(sites), tuple(link for _, link in links)


def parse_cluster(data: dict[str, Any], source: str = "<memory>", *, require_device: bool = True) -> Cluster:
    """Build a Cluster from already-parsed TOML data; ``source`` names it in errors. ``require_device=False``
    (the training scheduler) lets ``[device]`` be left out: the cluster then has a device with no antennas."""
    root = _Table(data, "", source)
    root.reject_unknown({"device", "workload", "servers", "sites", "links"})
    servers = _parse_servers(root)
    device = _parse_device(root) if require_device or root.has("device") else Device(antennas=(), declared=False)
    workload = _parse_workload(root)
    sites, links = _parse_sites(root, servers)
    if root.missing:
        raise ClusterError(f"{source}: {_missing(root.missing)}")
    for i, srv in enumerate(servers):
        if srv.antenna_addresses and len(srv.antenna_addresses) != len(device.antennas):
            raise root.fail(f"servers[{i}].antenna_addresses", f"has {len(srv.antenna_addresses)} addresses "
                            f"for {len(device.antennas)} antennas")
    return Cluster(device=device, servers=servers, workload=workload, sites=sites, links=links, source=source)


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
