"""An emulated edge network on one machine: antennas with a set bandwidth, servers with a set CPU share.

Real kernel mechanisms, outside the engine:
- every server runs in its own network namespace; each antenna is a namespace holding a bridge, joined
  to the device's namespace by a veth pair whose both directions are shaped with `tc tbf`
  (and an optional netem delay), so all servers reached over one antenna share its bandwidth, as on a
  radio link. Every server hangs off every antenna's bridge, with one address per antenna (the plan,
  not the wiring, decides which antenna serves which server); server-to-server traffic crosses a bridge
  unshaped, like a LAN between the servers;
- every server process runs in a cgroup with a CPU quota (cgroup v1 `cpu.cfs_quota_us` or v2
  `cpu.max`), e.g. 0.45 of one core.

Everything made is named with one prefix and removed on close, on SIGINT/SIGTERM, and, if the owning
process is killed outright, by a reaper process that watches it (`python -m deepco_bench.testbed --reap`).
Without root or `ip`/`tc`, the testbed falls back to loopback servers with app-level pacing and
process priorities, and says so in `label`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from deepco.errors import UserError

CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
MIN_CPU_SHARE = 0.1  # the kernel's smallest quota is 1 ms per period
CPU_PERIOD_US = 10_000  # a short period spreads the quota evenly over a slice's few milliseconds
CPU_WEIGHT_V2 = 10000  # the maximum (default 100)
CPU_SHARES_V1 = 262144  # the maximum (default 1024)
SUBNET = "10.213"  # only inside namespaces this module creates
_SERIAL = itertools.count()



RADIO_TICK_S = 0.001  # what a radio delivers at once: one LTE transmission interval's worth at its rate
MIN_BURST_BYTES = 4096  # above a 1500-byte packet, which tbf must be able to send whole
L2_HEADROOM = 64  # an Ethernet header and then some: tbf measures a packet with its link-layer header
# Every link's MTU. The emulated radio's packets cross veths, a bridge and two tbf shapers in softirq on the
# two cores the servers' quotas share, and this kernel has no IRQ time accounting: the work is charged to
# whichever process was running. At 1500 bytes a transfer to two servers slowed ORT in the two servers that
# received nothing by 31-38% (bench/radio_cost.py), a cost no separate machine would see; at 9000, by 2-4%.
DEFAULT_MTU = 9000
MTU_RANGE = (1280, 65535)


def _token_bucket(mbps: float, mtu: int = DEFAULT_MTU) -> list[str]:
    """tc's tbf arguments for a radio of ``mbps``: its bucket holds one radio tick's worth (at least
    ``MIN_BURST_BYTES``, and one packet of ``mtu`` bytes: under 72 Mbit/s a 9000-byte packet is more than a
    tick). A 64 KiB bucket, used before, sent 50 KB at "10 Mbit/s" in 0.2 ms after an idle
    moment (2 Gbit/s), so small transfers (a split's bands) crossed at line rate and a rise of the rate did not
    show in them. tbf cuts the veth's GSO super-packets to fit a small bucket, so none is dropped."""
    burst = max(MIN_BURST_BYTES, mtu + L2_HEADROOM, round(mbps * 1e6 / 8 * RADIO_TICK_S))
    return ["tbf", "rate", f"{mbps}mbit", "burst", str(burst), "latency", "400ms"]

class TestbedError(UserError):
    """The testbed could not be built (a kernel command failed)."""


@dataclass(frozen=True)
class ServerSpec:
    """One emulated server: its name and its share of one CPU core (None: unlimited)."""

    name: str
    cpu: float | None = None


@dataclass(frozen=True)
class TestbedSpec:
    """The emulated network: bandwidth of each antenna (Mbit/s), its one-way delay, the servers."""

    __test__ = False  # not a pytest test class, despite the name

    antenna_mbps: tuple[float, ...]
    servers: tuple[ServerSpec, ...]
    delay_ms: float = 0.0
    device_cpu: float | None = None  # the device's own share of a core (a camera is no workstation)
    peer_mbps: float | None = None  # each server's own link, which server-to-server traffic crosses (None: LAN)
    mtu: int = DEFAULT_MTU  # of every link the testbed makes (see DEFAULT_MTU)

    def __post_init__(self):
        if not self.antenna_mbps or any(b <= 0 for b in self.antenna_mbps):
            raise UserError("testbed: every antenna needs a positive bandwidth")
        if self.peer_mbps is not None and self.peer_mbps <= 0:
            raise UserError("testbed: the peer bandwidth must be positive")
        if self.device_cpu is not None and not MIN_CPU_SHARE <= self.device_cpu <= os.cpu_count():
            raise UserError(f"testbed: device CPU share {self.device_cpu} is outside "
                            f"[{MIN_CPU_SHARE}, {os.cpu_count()}]")
        if not MTU_RANGE[0] <= self.mtu <= MTU_RANGE[1]:
            raise UserError(f"testbed: MTU {self.mtu} is outside [{MTU_RANGE[0]}, {MTU_RANGE[1]}]")
        if len(self.servers) > 200:
            raise UserError("testbed: at most 200 servers")
        for s in self.servers:
            if s.cpu is not None and not MIN_CPU_SHARE <= s.cpu <= os.cpu_count():
                raise UserError(f"testbed: server {s.name} has CPU share {s.cpu}, outside "
                                f"[{MIN_CPU_SHARE}, {os.cpu_count()}]")


def kernel_emulation_available() -> str | None:
    """None if namespaces, tc and a cpu cgroup can be used here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    if cgroup_root() is None:
        return "no writable cpu cgroup controller"
    return None


def cgroup_root() -> tuple[str, Path] | None:
    """('v1', /sys/fs/cgroup/cpu) or ('v2', /sys/fs/cgroup), whichever offers the cpu controller."""
    if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists() and os.access(CGROUP_V1_CPU, os.W_OK):
        return "v1", CGROUP_V1_CPU
    controllers = CGROUP_V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split() and os.access(CGROUP_V2, os.W_OK):
        return "v2", CGROUP_V2
    return None


@contextlib.contextmanager
def cpu_quota_group(name: str, share: float, period_us: int = 100_000) -> Iterator[Path]:
    """A cpu cgroup ``name`` holding ``share`` of a core per ``period_us``; yields its ``cgroup.procs`` (write a
    pid there to put a process in it) and removes the group after (its processes must have ended)."""
    found = cgroup_root()
    if found is None:
        raise UserError("a CPU quota needs root and a writable cpu cgroup controller")
    version, root = found
    group = root / name
    group.mkdir()
    try:
        if version == "v1":
            (group / "cpu.cfs_period_us").write_text(str(period_us))
            (group / "cpu.cfs_quota_us").write_text(str(round(share * period_us)))
        else:
            (group / "cpu.max").write_text(f"{round(share * period_us)} {period_us}")
        yield group / "cgroup.procs"
    finally:
        group.rmdir()


def cpu_group_of(pid: int | str = "self") -> Path | None:
    """The directory of process ``pid``'s cpu cgroup, or None where there is no cpu cgroup hierarchy."""
    root = cgroup_root()
    if root is None:
        return None
    version, base = root
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (version == "v2" and controllers == "") or (version == "v1" and "cpu" in controllers.split(",")):
            return base / path.lstrip("/")
    return None


def cpu_quota_of(pid: int) -> float | None:
    """The CPU quota (cores) of process ``pid``'s cpu cgroup, or None if it has none (or none can be read).
    Read from outside the testbed's namespaces: `ip netns exec` mounts a sysfs of its own, without cgroups."""
    group = cpu_group_of(pid)
    if group is None:
        return None
    try:
        if (group / "cpu.max").exists():  # v2
            quota, period = (group / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota = int((group / "cpu.cfs_quota_us").read_text())
        return None if quota < 0 else quota / int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def _cgroup_mount() -> str:
    """Shell that mounts the cpu cgroup hierarchy at its usual place, for a process started by `ip netns exec`:
    that mounts a sysfs of its own, without the cgroup filesystems under it, so a camera on the testbed would not
    see its quota where one in a container does (device.cpu_share.cpu_budget read 2 cores at a 0.1-core quota,
    and a search that need not hurry was never held back). Mounting a hierarchy again shows the same groups.
    Fails quietly (no quota seen, as before) where mounting is not allowed."""
    found = cgroup_root()
    if found is None:
        return ""
    if found[0] == "v2":
        mount = "mount -t cgroup2 cgroup2 /sys/fs/cgroup"
    else:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        names = next((c for _, c, _ in (line.split(":", 2) for line in lines) if "cpu" in c.split(",")), "cpu")
        mount = (f"mount -t tmpfs cgroup /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/{names} && "
                 f"mount -t cgroup -o {names} cgroup /sys/fs/cgroup/{names}")
    return f"{{ {mount}; }} 2>/dev/null || :;"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise TestbedError(f"testbed: `{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result


def leftovers(prefix: str = "dc") -> dict[str, list[str]]:
    """Namespaces, root-namespace links and cgroups whose names start with ``prefix`` (for checks)."""
    found: dict[str, list[str]] = {"netns": [], "links": [], "cgroups": []}
    if shutil.which("ip"):
        netns = _run("ip", "netns", "list", check=False).stdout.split("\n")
        found["netns"] = [line.split()[0] for line in netns if line.startswith(prefix)]
        links = _run("ip", "-o", "link", "show", check=False).stdout.split("\n")
        found["links"] = [line.split(": ")[1].split("@")[0] for line in links
                          if line.count(": ") >= 2 and line.split(": ")[1].startswith(prefix)]
    found["cgroups"] = sorted(p.name for p in _cgroups_named(prefix))
    return found


def _cgroups_named(prefix: str, cgroups: Path | None = None) -> list[Path]:
    """The cpu cgroups whose names start with ``prefix`` in ``cgroups``, by default in the hierarchy's root and
    in this process's own group (where a testbed makes them: `Testbed.cgroups`)."""
    root = cgroup_root()
    if root is None:
        return []
    own = cpu_group_of()
    bases = [cgroups] if cgroups is not None else list(dict.fromkeys([root[1], *([own] if own else [])]))
    return [p for base in bases for p in base.glob(f"{prefix}*") if p.is_dir()]


def remove_everything(prefix: str, cgroups: Path | None = None) -> None:
    """Kill what runs in the prefix's namespaces and cgroups, then delete namespaces, links and cgroups
    (``cgroups``: the folder the groups are in, by default the cpu hierarchy's root and this process's own
    group)."""
    mine = leftovers(prefix)
    for ns in mine["netns"]:
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for group in _cgroups_named(prefix, cgroups):
        procs = group / "cgroup.procs"
        for pid in procs.read_text().split() if procs.exists() else []:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        for _ in range(50):  # a killed process leaves its cgroup a moment later
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.02)
    for ns in mine["netns"]:  # deleting a namespace deletes its veths and their qdiscs
        _run("ip", "netns", "del", ns, check=False)
    for link in mine["links"]:
        _run("ip", "link", "del", link, check=False)


@dataclass
class Testbed:
    """Build with `with Testbed(spec) as tb:`; start processes with `tb.spawn(...)`."""

    __test__ = False

    spec: TestbedSpec
    force_fallback: bool = False
    defer_cpu_limits: bool = False  # start processes at full speed; apply_cpu_limits() when they are up
    # (the device's group too: apply_cpu_limits() sets it, or apply_device_cpu_limit() on its own)
    # <= 7 characters, so that prefix + "s123" fits Linux's 15-character interface names
    prefix: str = field(default_factory=lambda: f"dc{(os.getpid() * 8 + next(_SERIAL)) % 0xFFFFF:05x}")
    processes: list[subprocess.Popen] = field(default_factory=list)
    kernel: bool = False
    reason: str | None = None
    _reaper: subprocess.Popen | None = None
    _previous_handlers: dict = field(default_factory=dict)
    # the cpu cgroup the testbed's groups are made in: the caller's own (an idle-priority group given to the
    # caller then bounds the testbed too, as `deepco demo` does), else the hierarchy's root
    cgroups: Path | None = None

    # -- names -------------------------------------------------------------------------------------------
    @property
    def device_ns(self) -> str:
        return f"{self.prefix}-dev"

    def antenna_ns(self, m: int) -> str:
        return f"{self.prefix}-a{m}"

    def server_ns(self, k: int) -> str:
        return f"{self.prefix}-s{k}"

    def server_host(self, k: int, antenna: int = 0) -> str:
        """The address the device reaches server k at over ``antenna``."""
        if not self.kernel:
            return "127.0.0.1"
        return f"{SUBNET}.{antenna}.{10 + k}"

    @property
    def label(self) -> str:
        """A line for every output: what is emulated, and how."""
        spec = self.spec
        bw = ", ".join(f"{b:g}" for b in spec.antenna_mbps)
        cpus = ", ".join("-" if s.cpu is None else f"{s.cpu:g}" for s in spec.servers)
        device = "unlimited" if spec.device_cpu is None else f"{spec.device_cpu:g} of a core"
        peers = "unshaped (LAN)" if spec.peer_mbps is None else f"{spec.peer_mbps:g} Mbit/s per server link"
        if self.kernel:
            return (f"EMULATED edge network: antennas {bw} Mbit/s (tc tbf, 1 ms bucket, MTU {spec.mtu}, "
                    f"delay {spec.delay_ms:g} ms, "
                    f"shared per antenna); server CPU shares {cpus} of a core, device {device} (cgroup quotas"
                    f"{', applied once each process has started up' if self.defer_cpu_limits else ''}); "
                    f"server-to-server {peers}; network namespaces")
        return (f"EMULATED edge network (fallback, {self.reason}): loopback, antennas {bw} Mbit/s by app-level "
                f"pacing only, server CPU shares {cpus} approximated by process priority only")

    # -- life cycle --------------------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        self.reason = "forced" if self.force_fallback else kernel_emulation_available()
        self.kernel = self.reason is None
        if self.kernel:
            own, root = cpu_group_of(), cgroup_root()
            self.cgroups = own if own is not None and os.access(own, os.W_OK) else (root[1] if root else None)
            self._catch_signals()
            self._start_reaper()
            try:
                self._build()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process and remove every namespace, link, qdisc and cgroup made."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.processes.clear()
        if self.kernel:
            remove_everything(self.prefix, self.cgroups)
            if self._reaper is not None and self._reaper.poll() is None:
                self._reaper.kill()
                self._reaper.wait()
            self._restore_signals()

    def _catch_signals(self) -> None:
        def stop(signum, frame):
            self.close()
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: the reaper still covers us
                self._previous_handlers[sig] = signal.signal(sig, stop)

    def _restore_signals(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _start_reaper(self) -> None:
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "deepco_bench.testbed", "--reap", str(os.getpid()), self.prefix,
             str(self.cgroups or "")],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _build(self) -> None:
        remove_everything(self.prefix, self.cgroups)  # a previous owner with our pid may have been killed
        p, spec = self.prefix, self.spec
        mtu = str(spec.mtu)
        ip = ("ip", "netns", "exec")
        _run("ip", "netns", "add", self.device_ns)
        _run(*ip, self.device_ns, "ip", "link", "set", "lo", "up")
        _run(*ip, self.device_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for m, mbps in enumerate(spec.antenna_mbps):
            ns = self.antenna_ns(m)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", f"{p}d{m}", "mtu", mtu, "type", "veth", "peer", "name", f"{p}u{m}", "mtu", mtu)
            _run("ip", "link", "set", f"{p}d{m}", "netns", self.device_ns, "name", f"ant{m}")
            _run("ip", "link", "set", f"{p}u{m}", "netns", ns, "name", "uplink")
            _run(*ip, ns, "ip", "link", "add", "name", "br0", "mtu", mtu, "type", "bridge")
            _run(*ip, ns, "ip", "link", "set", "uplink", "master", "br0")
            for dev in ("br0", "uplink", "lo"):
                _run(*ip, ns, "ip", "link", "set", dev, "up")
            _run(*ip, self.device_ns, "ip", "addr", "add", f"{SUBNET}.{m}.1/24", "dev", f"ant{m}")
            _run(*ip, self.device_ns, "ip", "link", "set", f"ant{m}", "up")
            self._shape(self.device_ns, f"ant{m}", mbps)  # downlink
            self._shape(ns, "uplink", mbps)  # uplink
        for k, server in enumerate(spec.servers):
            ns = self.server_ns(k)
            _run("ip", "netns", "add", ns)
            _run(*ip, ns, "ip", "link", "set", "lo", "up")
            for m in range(len(spec.antenna_mbps)):
                ant = self.antenna_ns(m)
                _run("ip", "link", "add", f"{p}s{k}", "mtu", mtu, "type", "veth", "peer", "name", f"{p}p{k}",
                     "mtu", mtu)
                _run("ip", "link", "set", f"{p}s{k}", "netns", ns, "name", f"ant{m}")
                _run("ip", "link", "set", f"{p}p{k}", "netns", ant, "name", f"s{k}")
                _run(*ip, ant, "ip", "link", "set", f"s{k}", "master", "br0")
                _run(*ip, ant, "ip", "link", "set", f"s{k}", "up")
                _run(*ip, ns, "ip", "addr", "add", f"{self.server_host(k, m)}/24", "dev", f"ant{m}")
                _run(*ip, ns, "ip", "link", "set", f"ant{m}", "up")
                if spec.peer_mbps is not None:  # the server's own radio: towards it and from it
                    self._shape(ant, f"s{k}", spec.peer_mbps)
                    self._shape(ns, f"ant{m}", spec.peer_mbps)
            self._make_cgroup(f"s{k}", None if self.defer_cpu_limits else server.cpu)
        self._make_cgroup("dev", None if self.defer_cpu_limits else spec.device_cpu)

    def _shape(self, ns: str, dev: str, mbps: float) -> None:
        """Token bucket at ``mbps`` on ``dev``'s egress; with a delay, a netem child under it."""
        tbf = _token_bucket(mbps, self.spec.mtu)
        if self.spec.delay_ms <= 0:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)
            return
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)
        result = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1",
                      "handle", "10:", "netem", "delay", f"{self.spec.delay_ms}ms", check=False)
        if result.returncode != 0:
            raise TestbedError(f"testbed: cannot emulate a {self.spec.delay_ms:g} ms delay: this kernel has no "
                               f"netem qdisc ({result.stderr.strip()}); run without a delay")

    def set_antennas(self, mbps: float) -> None:
        """Change every antenna's bandwidth, both directions, while processes run (`deepco bench --scenario`)."""
        if not self.kernel:
            raise TestbedError("testbed: changing an antenna's bandwidth mid-run needs the kernel emulation")
        tbf = _token_bucket(mbps, self.spec.mtu)
        handle = ["handle", "1:"] if self.spec.delay_ms > 0 else []
        for m in range(len(self.spec.antenna_mbps)):
            for ns, dev in ((self.device_ns, f"ant{m}"), (self.antenna_ns(m), "uplink")):
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", dev, "root", *handle, *tbf)

    def set_server_cpu(self, k: int, cpu: float) -> None:
        """Change server k's CPU share while it runs (`deepco bench --scenario`)."""
        if not self.kernel:
            raise TestbedError("testbed: changing a server's CPU share mid-run needs the kernel emulation")
        self._make_cgroup(f"s{k}", cpu)

    def apply_cpu_limits(self, device: bool = True) -> None:
        """Set every server's CPU quota, and with ``device`` the device's (after a deferred start)."""
        if self.kernel:
            for k, server in enumerate(self.spec.servers):
                self._make_cgroup(f"s{k}", server.cpu)
        if device:
            self.apply_device_cpu_limit()

    def apply_device_cpu_limit(self) -> None:
        """Set the device's CPU quota (after a deferred start): processes already spawned into the device's
        group run under it from now on."""
        if self.kernel:
            self._make_cgroup("dev", self.spec.device_cpu)

    def lift_device_cpu_limit(self) -> None:
        """Take the device's quota off again: a next run in the same testbed sets up, as the first did, before
        its quota applies (bench/plan_run.py)."""
        if self.kernel:
            self._make_cgroup("dev", None)

    def _cgroup(self, who: str) -> Path:
        assert self.cgroups is not None
        return self.cgroups / f"{self.prefix}-{who}"

    def _make_cgroup(self, who: str, cpu: float | None) -> None:
        version, _ = cgroup_root() or ("", None)
        group = self._cgroup(who)
        group.mkdir(exist_ok=True)
        quota = -1 if cpu is None else max(1000, round(cpu * CPU_PERIOD_US))
        # A quota is a ceiling, not a guarantee: anything else running on the machine would eat into the
        # emulated shares and make runs disagree. A high weight gives the testbed's groups their share first.
        if version == "v1":
            (group / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
            with contextlib.suppress(OSError):
                (group / "cpu.shares").write_text(str(CPU_SHARES_V1))
        else:
            (group / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {CPU_PERIOD_US}")
            with contextlib.suppress(OSError):
                (group / "cpu.weight").write_text(str(CPU_WEIGHT_V2))

    # -- processes ---------------------------------------------------------------------------------------
    def add_device(self, name: str) -> str:
        """A second device's cgroup (``dev-NAME``), with the device's CPU share: it runs in the device's namespace,
        so it shares the antennas (one radio cell), but not the first device's CPU. Its group for `spawn`."""
        if self.kernel:
            self._make_cgroup(f"dev-{name}", self.spec.device_cpu)
        return f"dev-{name}"

    def stop(self, proc: subprocess.Popen) -> None:
        """Stop one process `spawn` started (e.g. a server going down mid-run)."""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc in self.processes:
            self.processes.remove(proc)

    def spawn(self, argv: list[str], *, server: int | None = None, group: str | None = None,
              **popen) -> subprocess.Popen:
        """Start ``argv`` in server k's namespace and cgroup, or (server=None) in the device's (``group``: the
        cgroup `add_device` made for a second device).

        In fallback mode it runs here, niced in proportion to the server's CPU share.
        """
        if not self.kernel:
            cpu = None if server is None else self.spec.servers[server].cpu
            nice = 0 if cpu is None else max(0, min(19, round(10 * (1 - min(cpu, 1.0)))))
            cmd = ["nice", "-n", str(nice), *argv] if nice else list(argv)
        else:
            # Join the cgroup before exec so that no instruction runs outside the quota.
            who, ns = (group or "dev", self.device_ns) if server is None else (f"s{server}", self.server_ns(server))
            procs = self._cgroup(who) / "cgroup.procs"
            cmd = ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", "ip", "netns", "exec", ns,
                   "sh", "-c", f'{_cgroup_mount()} exec "$@"', "sh", *argv]
        proc = subprocess.Popen(cmd, **popen)
        self.processes.append(proc)
        return proc


def _reap(owner: int, prefix: str, cgroups: Path | None = None) -> None:
    """Wait for ``owner`` to die, then remove everything named with ``prefix`` (its cgroups in ``cgroups``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    remove_everything(prefix, cgroups)


if __name__ == "__main__":
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--reap":
        _reap(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]) if len(sys.argv) == 5 and sys.argv[4] else None)
    else:
        print("usage: python -m deepco_bench.testbed --reap OWNER_PID PREFIX [CGROUP_DIR]", file=sys.stderr)
        sys.exit(2)
