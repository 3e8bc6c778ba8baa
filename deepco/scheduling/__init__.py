"""Training-job scheduling on the shared cluster model: job model, simulator, policies, traces, lower bound.

The two edge-cloud JCT schedulers of the seeds (``online-batch``: She et al.; ``preemptive`` and
``preemptive-edge``: Wang et al.) and the baselines they compare against (``fifo``, ``drf``, ``srtf``,
``tiresias-l``, ``batchsche``) run in one discrete-time simulator that checks every constraint each slot.
"""

from deepco.scheduling.jobs import Job
from deepco.scheduling.policies import POLICIES, make_policy
from deepco.scheduling.simulator import Allocation, SimResult, SimulationError, Simulator, simulate
from deepco.scheduling.topology import SimCluster, bind_delays

__all__ = ["POLICIES", "Allocation", "Job", "SimCluster", "SimResult", "SimulationError", "Simulator",
           "bind_delays", "make_policy", "simulate"]
