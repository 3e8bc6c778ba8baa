"""The plan cache: the plan a cold start settled on, kept on the device so that a restart runs its first frame
on it instead of measuring and calibrating again.

A cold `deepco run --algorithm auto` measures, calibrates on its first live frames (device/planner.py) and
writes the plan it settled on, with what setup measured and what calibration fitted, to
``<cache dir>/plan-<digest of the key>.json`` (the cache dir: ``$XDG_CACHE_HOME/deepco``, else
``~/.cache/deepco``; ``--plan-cache DIR`` moves it, ``--no-plan-cache`` turns it off). A warm start, the same
key, reads it back and runs its first frame on that plan.

The key (`cache_key`) is everything the plan was measured on: each server's name, addresses and the id it
reports (ServerMetadata's ``deepco_server_id``: a server on other hardware, or with other threads, reports
another), the digests of the TLS certificates (under mutual TLS the servers know this device by its
certificate), the model's bytes (the preprocessing is in its graph), the input size, the preprocessing, the
antennas, pacing, the objective and the file format's version (`FORMAT`). The file is named by the key without
the ids (a server down at a start cannot give its id: its plan is still the one to start from, the server left
out as setup leaves it out); a server whose id changed makes it a miss. The file holds a plan as `deepco
plan --save` writes it, so `deepco run --plan FILE` runs it too, with the key, the measurements and the fit
beside it. A file that cannot be read, or that another format wrote, is one warning line: the run goes on cold.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deepco_device.backpressure import while_busy
from deepco_device.records import Measurements

from deepco.planning.links import LINK_BOUNDS
from deepco.planning.staged import DEVICE, StagedPlan
from deepco.wire.security import ChannelSecurity, read_pem

FORMAT = 2  # the cache file's format: a file of another one is not read (one warning line), and is replaced
# (2: plans across scales carry per-level tensor tables, deepco.planning.scales)


def plan_document(model: str, height: int, width: int, plan: StagedPlan) -> dict:
    """A saved plan's JSON: ``plan`` with the model and input size it was made for (`deepco plan --save` writes it,
    device.plan_command.load_plan reads it; the plan cache writes these fields too)."""
    return {"model": model, "input_size": [height, width], "plan": plan.to_dict()}


@dataclass(frozen=True)
class Cached:
    """What a cold start settled on: the plan, what setup measured, and what calibration fitted on top."""

    plan: StagedPlan
    measured: Measurements
    compute_scale: float
    step_overhead: float
    probe_ratio: float | None = None  # setup's model/probe speed ratio, for servers measured later; None: unknown
    balance: dict[str, float] = field(default_factory=dict)  # the servers' slowness against each other (fitted)
    links: dict[int, float] = field(default_factory=dict)  # each antenna's time against its probe's (fitted)


def _links(data: dict) -> dict[int, float]:
    """A cache file's fitted antenna factors and streamed windows' rests' factor (`deepco.planning.links`), each
    within ``LINK_BOUNDS``."""
    links = {int(k): float(v) for k, v in data.items()}
    low, high = LINK_BOUNDS
    if not all(low <= v <= high for v in links.values()):
        raise ValueError(f"its antenna factors {links} are not all within {low:g}-{high:g}")
    return links


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


OUTPUT_SIDE = ("origin", "output", "score_threshold", "iou_threshold", "class_names")


def cache_key(device, objective: str, down: Collection[str] = ()) -> dict:
    """The key of ``device``'s plan (see the module doc), as JSON values. Asks every server but those ``down``
    for its id (theirs is None: a server that is down cannot say)."""
    cluster, security = device.cluster, device.security or ChannelSecurity()  # None: plain text, no token
    antennas = range(len(cluster.device.antennas))
    servers = []
    for k, server in enumerate(cluster.servers):
        client = device.client(k, 0)
        known = server.name not in down
        servers.append({"name": server.name, "addresses": [cluster.address_on(server, m) for m in antennas],
                        "id": while_busy(client.server_metadata).get("deepco_server_id", "") if known else None})
    tls = {label: _digest(read_pem(pem, label)) for label, pem in (("ca", security.ca), ("cert", security.cert))
           if pem is not None}
    # what the outputs mean changes no plan: only the input side of the preprocessing is in the key
    how = {k: v for k, v in asdict(device.preprocessing).items() if k not in OUTPUT_SIDE}
    key = {"format": FORMAT, "servers": servers, "tls": tls, "model_sha256": _digest(device.model.SerializeToString()),
           "input_size": [device.height, device.width], "preprocessing": how, "objective": objective,
           "antennas": [a.bandwidth for a in cluster.device.antennas], "paced": device.pace}
    return json.loads(json.dumps(key))  # tuples as lists: the form it is read back in


def _measurements(data: dict) -> Measurements:
    """`Measurements` from its JSON form, every number checked to be one (TypeError, ValueError otherwise)."""
    numbers = {k: float(data[k]) for k in ("request_overhead", "device_flops_per_second", "peer_bytes_per_second",
                                           "peer_overhead", "device_seconds_per_byte")}
    return Measurements({str(k): float(v) for k, v in data["server_flops_per_second"].items()},
                        [float(b) for b in data["antenna_bytes_per_second"]], paced=bool(data["paced"]), **numbers)


def _where(key: dict) -> dict:
    """``key`` without the servers' ids: what names the file. A server down at a start cannot give its id, and
    the plan cached for its address is still the one to start from."""
    return key | {"servers": [{k: v for k, v in s.items() if k != "id"} for s in key["servers"]]}


def _other_ids(stored: dict, key: dict) -> list[str]:
    """The servers of ``key`` whose id is not the one ``stored`` (a cached file's key) holds; those down now
    (id None) are taken on trust: measured again when they answer (`Device.measure_server`)."""
    return [f"{now['name']} reports id {now['id']!r}, not {then.get('id')!r}"
            for now, then in zip(key["servers"], stored["servers"], strict=True)
            if now["id"] is not None and now["id"] != then.get("id")]


class PlanCache:
    """The plan cache in ``directory`` (see the module doc); problems go to ``log`` as one warning line each."""

    def __init__(self, directory: Path, log: Callable[[str], None]):
        self.directory, self.log = Path(directory), log

    def path(self, key: dict) -> Path:
        """The file of ``key``."""
        return self.directory / f"plan-{_digest(json.dumps(_where(key), sort_keys=True).encode())[:32]}.json"

    def load(self, key: dict) -> Cached | None:
        """The plan cached under ``key``, or None: none is, or the file cannot be used (one warning line)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            if data.get("format") != FORMAT:
                self.log(f"warning: plan cache {path}: written in format {data.get('format')!r}, this version reads "
                         f"{FORMAT}; calibrating afresh")
                return None
            if not isinstance(data.get("key"), dict) or _where(data["key"]) != _where(key):
                raise ValueError("its key is not the key it is filed under")
            if changed := _other_ids(data["key"], key):
                self.log(f"plan cache {path}: {'; '.join(changed)} as when it was written; calibrating afresh")
                return None
            ratio = data.get("probe_ratio")
            cached = Cached(StagedPlan.from_dict(data["plan"]), _measurements(data["measured"]),
                            float(data["compute_scale"]), float(data["step_overhead"]),
                            None if ratio is None else float(ratio),
                            {str(k): float(v) for k, v in data.get("balance", {}).items()},
                            _links(data.get("links", {})))
            names = {s["name"] for s in key["servers"]}
            measured = set(cached.measured.server_flops_per_second)
            if not set(cached.plan.servers) <= names | {DEVICE} or measured != names:
                raise ValueError("it names servers the cluster file does not")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            why = " ".join(str(exc).split()) or type(exc).__name__
            self.log(f"warning: plan cache {path}: unreadable ({why}); calibrating afresh")
            return None
        return cached

    def store(self, key: dict, model: str, cached: Cached) -> Path | None:
        """Write ``cached`` under ``key`` (atomically: a reader sees the old file or the new one); its path, or
        None when it cannot be written (one warning line: the run goes on)."""
        path = self.path(key)
        height, width = key["input_size"]
        data = {"format": FORMAT, "key": key, **plan_document(model, height, width, cached.plan),
                "measured": cached.measured.to_dict(), "compute_scale": cached.compute_scale,
                "step_overhead": cached.step_overhead, "probe_ratio": cached.probe_ratio, "balance": cached.balance,
                "links": {str(m): k for m, k in cached.links.items()}}
        temporary = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.directory, suffix=".tmp", delete=False) as f:
                temporary = f.name
                json.dump(data, f, indent=1)
            os.replace(temporary, path)
        except OSError as exc:
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            self.log(f"warning: plan cache {self.directory}: cannot write ({exc}); the next start calibrates again")
            return None
        return path


def directory(given: str | None) -> Path:
    """The plan cache's folder: ``given`` (``--plan-cache DIR``), else the XDG cache folder's ``deepco``, where
    zoo exports are kept too."""
    from deepco.model_cache import cache_home

    return Path(given) if given else cache_home()


class CacheUse:
    """The plan cache as one command uses it: ``cached`` is the plan of a warm start (the device's measurements
    and fit are restored from it), None on a cold one or where the cache is off (``folder`` None: `deepco run
    --no-plan-cache`, or a plan that calibrates nothing). Servers down at the start (``down``) are left out as
    setup leaves them out, and join when they answer; their ids are taken on trust, and nothing is written
    from such a start (its plan was not measured with them). ``say``: where the cache's lines go (stdout, or
    stderr beside a JSON output)."""

    def __init__(self, device, folder: Path | None, model: str, objective: str, say: Callable[[str], None]):
        self.cache: PlanCache | None = None
        self.key: dict | None = None
        self.cached: Cached | None = None
        self.down: dict[str, str] = {}
        self.model, self.say = model, say
        if folder is None:
            return
        device.load()
        self.down = dict(device.reach())
        self.cache = PlanCache(folder, say)
        self.key = cache_key(device, objective, self.down)
        self.cached = self.cache.load(self.key)
        if self.cached is not None:
            c = self.cached
            device.restore(c.measured, c.compute_scale, c.step_overhead, c.probe_ratio, c.balance, c.links)
            say(f"plan cache: warm start from {self.cache.path(self.key)}: no measuring, no calibration")

    def plan(self, planner, objective: str) -> StagedPlan:
        """The cached plan to start on; where it runs on servers down at the start, what failover would run
        instead: the planner's best (``planner``: a device/planner.StagedPlanner) without them, on the cached
        measurements and fit (one line)."""
        assert self.cached is not None, "a warm start only"
        gone = sorted(set(self.cached.plan.servers) & set(self.down))
        if not gone:
            return self.cached.plan
        plan = planner.best(objective)
        self.say(f"plan cache: the cached plan runs on {', '.join(gone)}, down at start: starting on "
                 f"{plan.brief()} (planned on the cached measurements)")
        return plan

    def store(self, device, plan: StagedPlan, unsettled: str | None = None) -> None:
        """Keep ``plan``, which calibration settled on, for the next start; nothing where calibration did not
        run to its end (``unsettled`` says why: the plan was not measured against the others), or where
        servers were down at the start."""
        if self.cache is None:
            return
        if self.down:
            self.say(f"plan cache: nothing written: {', '.join(self.down)} down at start (the plan was not measured "
                     "with them)")
            return
        if unsettled is not None:
            self.say(f"plan cache: nothing written: {unsettled} before calibration settled")
            return
        m = device.measurements
        cached = Cached(plan, m.measurements, m.compute_scale, m.step_overhead, m.probe_ratio, dict(m.balance),
                        dict(m.links))
        path = self.cache.store(self.key, self.model, cached)
        if path is not None:
            self.say(f"plan cache: wrote {path}")
