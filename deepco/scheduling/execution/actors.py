"""The two kinds of Ray actor a running job is made of: its parameter server and its worker groups.

Plain classes (``ray.remote`` wraps them in ``ray_executor``), so this module imports without Ray. The digits
come from the driver through Ray's object store (``data``), so no actor imports scikit-learn.

- ``ParameterServer``: holds the job's parameters, applies every pushed gradient at once (asynchronous SGD, as
  in eq. (1) of both seeds: each worker's rate does not depend on the others), hands out one *ticket* per
  mini-batch so that the job trains exactly the work the schedule gave it in this step, paced evenly over the
  step (and on past its end when it is late), and checkpoints to the shared directory (atomically: write,
  then rename) once per slot and on demand.
- ``WorkerGroup``: the ``count`` workers a job runs on one server (one Ray actor holding ``count`` units of
  that server's worker resource). Each worker pulls the parameters, computes one mini-batch's gradient on
  its own stream of samples and pushes it; the workers take turns, so the group needs one process.
"""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path

import numpy as np

from deepco.scheduling.execution import training

BATCH = 32


def _assigned() -> dict[str, float]:
    import ray

    return dict(ray.get_runtime_context().get_assigned_resources())


class ParameterServer:
    """One job's PS: parameters, tickets, checkpoints."""

    def __init__(self, job_id: int, seed: int, lr: float, checkpoint: str, checkpoint_every: float,
                 data: tuple[np.ndarray, ...]):
        self.job_id, self.lr = job_id, lr
        self.x_test, self.y_test = data[2], data[3]
        self.path = Path(checkpoint)
        self.every = checkpoint_every
        if self.path.exists():
            with np.load(self.path) as z:
                self.params = {k: z[k] for k in ("w1", "b1", "w2", "b2")}
                self.steps, self.checkpoints = int(z["steps"]), int(z["checkpoints"])
            self.restored_from: int | None = self.steps
        else:
            self.params = training.init_params(seed)
            self.steps, self.checkpoints, self.restored_from = 0, 0, None
        self.last_checkpoint = time.time()
        self.quota, self.issued, self.begin, self.deadline = 0, 0, 0.0, 0.0
        self.last_update: float | None = None

    def info(self) -> dict[str, object]:
        """Where it runs (Ray's assigned resources, pid) and what it restored."""
        return {"resources": _assigned(), "pid": os.getpid(), "steps": self.steps,
                "restored_from": self.restored_from, "checkpoints": self.checkpoints}

    def begin_step(self, quota: int, deadline: float) -> None:
        """Allow ``quota`` more mini-batches, paced evenly until ``deadline`` (wall clock, seconds)."""
        self.quota, self.issued = quota, 0
        self.begin, self.deadline = time.time(), deadline

    def pull(self) -> tuple[str, object, int]:
        """("go", params, version) with a ticket, ("wait", seconds, 0), or ("stop", None, 0) for this step."""
        now = time.time()
        if self.issued >= self.quota:  # a late step runs on past its deadline until its work is done
            return "stop", None, 0
        due = self.begin + self.issued * (self.deadline - self.begin) / self.quota
        if now < due:
            return "wait", min(due, self.deadline) - now, 0
        self.issued += 1
        return "go", self.params, self.steps

    def push(self, grads: dict[str, np.ndarray]) -> None:
        """Apply one worker's gradient; checkpoint when a slot's worth of time has passed since the last."""
        training.sgd(self.params, grads, self.lr)
        self.steps += 1
        self.last_update = time.time()
        if self.last_update - self.last_checkpoint >= self.every:
            self.checkpoint()

    def checkpoint(self) -> int:
        """Write parameters and step count to the shared directory; returns the checkpoints written so far."""
        self.checkpoints += 1
        tmp = self.path.with_suffix(".tmp.npz")
        np.savez(tmp, steps=self.steps, checkpoints=self.checkpoints, **self.params)
        os.replace(tmp, self.path)
        self.last_checkpoint = time.time()
        return self.checkpoints

    def status(self) -> dict[str, object]:
        """Steps so far, the time of the last update, checkpoints written."""
        return {"steps": self.steps, "last_update": self.last_update, "checkpoints": self.checkpoints}

    def evaluate(self) -> tuple[float, float]:
        """(loss, accuracy) of the current parameters on the held-out digits."""
        return training.evaluate(self.params, self.x_test, self.y_test)


class WorkerGroup:
    """``count`` workers of one job on one server."""

    def __init__(self, job_id: int, server: str, count: int, seed: int, data: tuple[np.ndarray, ...]):
        self.count = count
        self.x, self.y = data[0], data[1]
        # one stream of samples per worker, different on every server and after every restart
        self.rngs = [np.random.default_rng([seed, job_id, zlib.crc32(server.encode()), i, os.getpid()])
                     for i in range(count)]

    def info(self) -> dict[str, object]:
        """Where it runs (Ray's assigned resources) and its pid."""
        return {"resources": _assigned(), "pid": os.getpid()}

    def run(self, ps: object) -> dict[str, object]:
        """Train until the PS says stop for this step; returns the mini-batches pushed and when."""
        import ray

        start, pushed, turn = time.time(), 0, 0
        while True:
            kind, value, _ = ray.get(ps.pull.remote())  # type: ignore[attr-defined]
            if kind == "stop":
                break
            if kind == "wait":
                time.sleep(float(value))  # type: ignore[arg-type]
                continue
            rng = self.rngs[turn % self.count]
            turn += 1
            idx = rng.integers(0, len(self.y), BATCH)
            _, grads = training.loss_and_grads(value, self.x[idx], self.y[idx])  # type: ignore[arg-type]
            ray.get(ps.push.remote(grads))  # type: ignore[attr-defined]
            pushed += 1
        return {"pushed": pushed, "start": start, "end": time.time()}
