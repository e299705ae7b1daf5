"""Multi-host start-up: `jax.distributed.initialize` from the platform, flags as the override.

    from cbs.runtime import distributed
    distributed.initialize()                          # auto: TPU pod, Slurm, Open MPI, or 1
    distributed.initialize("10.0.0.1:1234", 4, 2)    # explicit (the --coordinator_address,
                                                      # --num_processes, --process_id flags)

Detection is JAX's own (`detect`); elsewhere the run is one process. Call it before anything
touches a device. `--distributed=auto|on|off` (`from_flags`): `auto` joins when the
environment says so, `on` requires it, `off` never joins (with `--shard=auto`, each host runs
the shard of its index: `host_shard`). docs/scaling.md gives each platform's commands and
where the records and checkpoints of several hosts go.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
from absl import flags

__all__ = ["detect", "from_flags", "initialize", "shutdown"]

_MODES = ("auto", "on", "off")

if "distributed" not in flags.FLAGS:
    flags.DEFINE_enum("distributed", "auto", list(_MODES), "Join a multi-process runtime: auto "
                      "(when the TPU slice, Slurm step or Open MPI says so), on (required), "
                      "off (each process runs alone; one shard per host with --shard=auto).")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 for multi-host "
                        "runs (with --num_processes and --process_id; overrides detection).")
    flags.DEFINE_integer("num_processes", None, "Processes in a multi-host run.")
    flags.DEFINE_integer("process_id", None, "This process's index.")


def detect(environ: Mapping[str, str] | None = None) -> str | None:
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


def host_shard(environ: dict[str, str] | None = None) -> str | None:
    """This host's shard "i/n" (TPU worker, Slurm task or Open MPI rank), or None."""
    env = os.environ if environ is None else environ
    how = detect(env)
    if how == "tpu":
        hosts = [h for h in env["TPU_WORKER_HOSTNAMES"].split(",") if h]
        return f"{int(env.get('TPU_WORKER_ID', '0'))}/{len(hosts)}"
    if how == "slurm":
        return f"{int(env['SLURM_PROCID'])}/{int(env['SLURM_NTASKS'])}"
    if how == "ompi":
        return f"{int(env.get('OMPI_COMM_WORLD_RANK', '0'))}/{int(env['OMPI_COMM_WORLD_SIZE'])}"
    return None


def resolve_shard(shard: str | None, mode: str = "off",
                  environ: dict[str, str] | None = None) -> str | None:
    """`--shard` with "auto" replaced by `host_shard()` (needs --distributed other than on)."""
    if shard != "auto":
        return shard
    if mode == "on":
        raise ValueError("--shard=auto runs one shard per host: use --distributed=off (or "
                         "auto), not on")
    found = host_shard(environ)
    if found is None:
        raise ValueError("--shard=auto: no TPU slice, Slurm step or Open MPI launch with "
                         "several processes found; give --shard=i/n")
    return found


def from_flags(shard: str | None = None) -> str | None:
    """`initialize` from the flags; returns the command's --shard `shard` resolved
    (`resolve_shard`; with "auto", --distributed=auto means off)."""
    f = flags.FLAGS
    mode = "off" if shard == "auto" and f.distributed == "auto" else f.distributed
    shard = resolve_shard(shard, mode)
    initialize(f.coordinator_address, f.num_processes, f.process_id, mode=mode)
    return shard


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, mode: str = "auto", timeout_s: int = 300) -> str:
    """Joins this process to its multi-host runtime; returns how ("explicit", "tpu", "slurm",
    "ompi", "single" when there is nothing to join, "off" when asked not to).

    coordinator_address, num_processes, process_id: all three or none (override detection)."""
    if mode not in _MODES:
        raise ValueError(f"--distributed must be one of {', '.join(_MODES)}, got {mode!r}")
    explicit = coordinator_address is not None
    if explicit and mode == "off":
        raise ValueError("--distributed=off contradicts --coordinator_address: drop one")
    if explicit and (num_processes is None or process_id is None):
        raise ValueError("--coordinator_address needs --num_processes and --process_id too")
    if mode == "off":
        return "off"
    how = "explicit" if explicit else detect()
    if how is None and mode == "on":
        raise ValueError("--distributed=on: no multi-process environment (a TPU slice with "
                         "several hosts, a Slurm step with several tasks, Open MPI) and no "
                         "--coordinator_address")
    if how is None:
        return "single"
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {} if not explicit else dict(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id)
    jax.distributed.initialize(initialization_timeout=timeout_s, **kwargs)
    return how


def shutdown() -> None:
    """Leaves the runtime (a no-op in a single process)."""
    if jax.process_count() > 1:
        jax.distributed.shutdown()
