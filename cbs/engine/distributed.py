"""Multi-host start-up: `jax.distributed.initialize` from the platform, flags as the override.

    from cbs.engine import distributed
    distributed.initialize()                          # auto: TPU pod, Slurm, Open MPI, or 1
    distributed.initialize("10.0.0.1:1234", 4, 2)    # explicit (the --coordinator_address,
                                                      # --num_processes, --process_id flags)

Auto-detection is JAX's own (`jax.distributed.initialize()` with no arguments reads the
cluster's environment): a multi-host Cloud TPU slice (TPU_WORKER_HOSTNAMES lists several
workers), a Slurm step with several tasks (SLURM_NTASKS > 1; coordinator on the first node of
SLURM_STEP_NODELIST, port from SLURM_JOB_ID) or an Open MPI launch (OMPI_COMM_WORLD_SIZE > 1).
Elsewhere (a laptop, one GPU host, one TPU VM) nothing is initialised and the run is one
process. Call it first, before anything touches a device.

After it, every process runs the same program on the global mesh; process 0 writes records,
status and config (`cbs.engine.loop`), all processes write their checkpoint shards through
orbax, whose file layer (etils.epath) also takes `gs://` paths: point --workdir or
--sweep_dir at a directory every host sees (a shared file system or a bucket).
"""

from __future__ import annotations

import os
from typing import Any

import jax

__all__ = ["ENVIRONMENTS", "detect", "initialize", "shutdown"]

ENVIRONMENTS = ("tpu", "slurm", "ompi")


def detect(environ: dict[str, str] | None = None) -> str | None:
    """The multi-process environment this process runs in: "tpu" | "slurm" | "ompi" | None."""
    env = os.environ if environ is None else environ
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "tpu"
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in env for k in slurm) and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "ompi"
    return None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 300) -> str:
    """Joins this process to its multi-host runtime; returns how ("explicit", an ENVIRONMENTS
    name, or "single" when there is nothing to join).

    Args:
      coordinator_address: host:port of process 0; given, the three arguments override any
        detection (all three are then required).
      num_processes, process_id: this run's process count and this process's index.
      timeout_s: how long to wait for the other processes.
    """
    explicit = coordinator_address is not None
    if explicit and (num_processes is None or process_id is None):
        raise ValueError("--coordinator_address needs --num_processes and --process_id too")
    how = "explicit" if explicit else detect()
    if how is None:
        return "single"
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = dict(coordinator_address=coordinator_address,
                                  num_processes=num_processes,
                                  process_id=process_id) if explicit else {}
    jax.distributed.initialize(initialization_timeout=timeout_s, **kwargs)
    return how


def shutdown() -> None:
    """Leaves the runtime (a no-op in a single process)."""
    if jax.process_count() > 1:
        jax.distributed.shutdown()
