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
antennas, pacing, the objective and the file format's version (`FORMAT`). The file holds a plan as `deepco
plan --save` writes it, so `deepco run --plan FILE` runs it too, with the key, the measurements and the fit
beside it. A file that cannot be read, or that another format wrote, is one warning line: the run goes on cold.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from deepco_device.backpressure import while_busy
from deepco_device.plan_command import plan_document
from deepco_device.records import Measurements

from deepco.planning.staged import DEVICE, StagedPlan
from deepco.wire.security import read_pem

FORMAT = 1  # the cache file's format: a file of another one is not read (one warning line), and is replaced


@dataclass(frozen=True)
class Cached:
    """What a cold start settled on: the plan, what setup measured, and what calibration fitted on top."""

    plan: StagedPlan
    measured: Measurements
    compute_scale: float
    step_overhead: float


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


OUTPUT_SIDE = ("origin", "output", "score_threshold", "iou_threshold", "class_names")


def cache_key(device, objective: str) -> dict:
    """The key of ``device``'s plan (see the module doc), as JSON values. Waits for every server to be ready
    (a server that is not is the one-line error setup gives) and asks each for its id."""
    cluster, security = device.cluster, device.security
    antennas = range(len(cluster.device.antennas))
    servers = []
    for k, server in enumerate(cluster.servers):
        client = device.client(k, 0)
        client.wait_ready(timeout=10.0)
        servers.append({"name": server.name, "addresses": [cluster.address_on(server, m) for m in antennas],
                        "id": while_busy(client.server_metadata).get("deepco_server_id", "")})
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


class PlanCache:
    """The plan cache in ``directory`` (see the module doc); problems go to ``log`` as one warning line each."""

    def __init__(self, directory: Path, log: Callable[[str], None]):
        self.directory, self.log = Path(directory), log

    def path(self, key: dict) -> Path:
        """The file of ``key``."""
        return self.directory / f"plan-{_digest(json.dumps(key, sort_keys=True).encode())[:32]}.json"

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
            if data.get("key") != key:
                raise ValueError("its key is not the key it is filed under")
            cached = Cached(StagedPlan.from_dict(data["plan"]), _measurements(data["measured"]),
                            float(data["compute_scale"]), float(data["step_overhead"]))
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
                "step_overhead": cached.step_overhead}
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
