"""The parts of a device (device.session.Device is their facade): its model artefacts, its links to the servers
(channels and uploads), and its measurements with what calibration fitted on top of them."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import onnx
from deepco_device.channels import Channels
from deepco_device.lifecycle import Uploads
from deepco_device.preprocess import Preprocessing
from deepco_device.records import Measurements

from deepco.cluster import Cluster
from deepco.errors import UserError
from deepco.modelcard import check_input
from deepco.partition import Partitioner, load_model
from deepco.partition.graph import model_size_problem
from deepco.partition.pixels import with_pixel_input
from deepco.planning.calibration import with_balance, with_compute_scale
from deepco.planning.links import with_links
from deepco.planning.staged import CostModel, Rates
from deepco.wire.client import InferenceClient
from deepco.wire.security import ChannelSecurity


class ModelArtefacts:
    """The model as the device runs it: the reference model, the model with the normalisation in its graph
    (the device sends uint8 pixels), its partitioner and exact cost model, and the stage models extracted per
    chain of levels (device.runners: a replan onto the same levels costs no extraction)."""

    def __init__(self, spec: str, height: int, width: int, weights: str | None, preprocessing: Preprocessing):
        self.spec, self.height, self.width, self.weights = spec, height, width, weights
        self.preprocessing = preprocessing
        self.channels = preprocessing.channels  # colour channels of the pixels sent
        self.tag = re.sub(r"[^A-Za-z0-9_.-]", "_", spec.rsplit("/", 1)[-1])
        self.reference_model: onnx.ModelProto | None = None
        self.model: onnx.ModelProto | None = None
        self.partitioner: Partitioner | None = None
        self.stage_models: dict[tuple[str, ...], dict] = {}
        self._costs: CostModel | None = None

    def load(self) -> None:
        """Load (or export) the model, check its input and build its partitioner."""
        self.reference_model = load_model(self.spec, self.height, self.width, self.weights)
        how = self.preprocessing
        check_input(self.reference_model, how)  # a clear error before ORT sees the wrong pixels
        problem = model_size_problem(self.reference_model, self.height, self.width)
        if problem:
            raise UserError(problem)
        self.model = with_pixel_input(self.reference_model, how.mean, how.std, how.scale)
        self.partitioner = Partitioner(self.model, self.height, self.width, name=self.spec)  # errors name it

    @property
    def costs(self) -> CostModel:
        """The staged planner's cost model of this model (deepco.planning.staged), made once."""
        if self._costs is None:
            image_bytes = self.channels * self.height * self.width * self.partitioner.graph.itemsize
            self._costs = CostModel(self.partitioner, image_bytes, self.output_bytes())
        return self._costs

    def output_bytes(self) -> int:
        """Bytes of every output of one frame (each comes back to the device), at this input size: a
        detector's raw heads at 736x1280 are 11 MB. Shapes from the partitioner's shape inference at the
        size, since a dynamic export declares its outputs' rows and columns as names (counting those as 1
        made yolov8n's 11 MB look like 600 bytes, and calibration put the missing 0.9 s of a 100 Mbit/s
        antenna into a fourfold "compute scale" of every server)."""
        shapes = self.partitioner.graph.shapes
        total = 0
        for o in self.reference_model.graph.output:
            tensor = o.type.tensor_type
            dims = shapes.get(o.name) or [d.dim_value or 1 for d in tensor.shape.dim]  # batch 1
            total += onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize * math.prod(dims)
        return total


class Links:
    """The device's links to its servers: a channel per (server, antenna), and the models uploaded over them
    (unloaded on `close`)."""

    def __init__(self, cluster: Cluster, security: ChannelSecurity | None, pace: bool,
                 log: Callable[[str], None] = print):
        self.cluster, self.security, self.pace = cluster, security, pace
        self.pool = Channels(cluster, security)
        servers = {s.name: s for s in cluster.servers}
        # a server reaches a peer where split plans tell it to (device.runners' peers): the peer's first antenna
        self.uploads = Uploads(log, lambda name: cluster.address_on(servers[name], 0) if name in servers else None)

    def client(self, server: int, antenna: int) -> InferenceClient:
        """The channel to ``server`` (index in the cluster) over ``antenna`` (opened once)."""
        return self.pool.client(server, antenna)

    def close(self, down: Iterable[str], log: Callable[[str], None]) -> None:
        """Unload what was uploaded (not from the servers in ``down``: a frozen one would stall it), then
        close every channel."""
        for problem in self.uploads.release(skip=set(down)):
            log(f"warning: {problem}")
        self.pool.close()


class Measured:
    """What setup measured (`Measurements`; None until then) and the cost model's terms calibration fitted on
    top (deepco.planning.calibration): the rates every plan of the device is predicted on."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.measurements: Measurements | None = None
        self.compute_scale = 1.0
        self.step_overhead = 0.0
        # each server's slowness on this model against the others' (calibration.Balance.factors; {}: as probed)
        self.balance: dict[str, float] = {}
        # each antenna's time against its probe's, as calibration's frames carried the windows
        # (deepco.planning.links.Links.factors; {}: as probed)
        self.links: dict[int, float] = {}
        # servers down at the start, not measured: no plan counts on them until they answer and are measured
        self.unreached: dict[str, str] = {}  # name -> why (e.g. 'connection refused')
        # a server's rate on the model per FLOP/s on the probe (device.measuring.measure); None: not known (an old
        # plan cache's measurements: a server measured later keeps its cached rate)
        self.probe_ratio: float | None = 1.0

    def rates(self, exclude: Iterable[str] = ()) -> Rates:
        """The measured rates with the fitted compute scale and step overhead, without the servers in
        ``exclude``."""
        r = with_compute_scale(with_links(with_balance(self.measurements.rates(), self.balance), self.links),
                               self.compute_scale)
        r.step_overhead = self.step_overhead
        for name in exclude:
            r.server_flops_per_second.pop(name, None)
        return r

    def servers(self, exclude: Iterable[str] = ()) -> list[str]:
        """Names of the servers not in ``exclude`` (nor unreached at the start), in cluster order."""
        skip = set(exclude) | set(self.unreached)
        return [s.name for s in self.cluster.servers if s.name not in skip]
