"""Okita (Han et al.): cost-aware online scheduling of unbiased distributed learning jobs over edge sites,
with its baselines (FIFO, DRF, OASiS as the paper describes them) and the exact optimum on small instances."""

from deepco.scheduling.okita.baselines import Oasis, UdlDrf, UdlFifo
from deepco.scheduling.okita.engine import UdlError, UdlResult, run_udl
from deepco.scheduling.okita.model import LatencyCost, SlotDecision, UdlInstance, UdlJob
from deepco.scheduling.okita.policy import Okita

UDL_POLICIES = {
    "okita": lambda seed: Okita(),
    "okita-fifo": lambda seed: UdlFifo(seed=seed),
    "okita-drf": lambda seed: UdlDrf(seed=seed),
    "okita-oasis": lambda seed: Oasis(),
}

__all__ = ["UDL_POLICIES", "LatencyCost", "Oasis", "Okita", "SlotDecision", "UdlDrf", "UdlError", "UdlFifo",
           "UdlInstance", "UdlJob", "UdlResult", "run_udl"]
