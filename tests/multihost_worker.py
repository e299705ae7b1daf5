"""One process of a local multi-process run (launched by tests/test_multihost.py).

    python tests/multihost_worker.py --process_id=I --num_processes=N --port=P \
        --devices=D --workdir=DIR --out=FILE.npz [--steps=S --full=1 --lm=1 --auto=1]

Each process gets D fake CPU devices; with N > 1 they join one JAX runtime on 127.0.0.1
(CPU collectives over gloo) and train the tiny digits config in DIR as one program. Process 0
writes the final parameters to --out. --lm=1 trains the tiny scanned LM instead (FSDP × TP);
--auto=1 joins by `cbs.runtime.distributed.initialize()` from the (Slurm) environment the
parent set, without flags.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("process_id", "num_processes", "port", "devices", "steps", "full", "lm",
                 "auto"):
        parser.add_argument(f"--{name}", type=int, default=0)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={args.devices} "
                               + os.environ.get("XLA_FLAGS", ""))  # the tests' compile level
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

    import jax
    import numpy as np

    if args.auto:
        from cbs.runtime import distributed
        distributed.initialize(timeout_s=60)
    elif args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                                   num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=60)
    from cbs.engine import loop, trainer
    from tests.test_multihost import lm_worker_config, worker_config

    config = (lm_worker_config(args.steps) if args.lm else
              worker_config(args.steps, bool(args.full)))
    tr = trainer.Trainer(config, args.workdir)
    run = loop.Loop(tr)
    summary = run.run()
    from jax.experimental import multihost_utils

    # Sharded parameters (FSDP × TP) span both processes: gather them whole on each.
    params = jax.tree.map(np.asarray, multihost_utils.process_allgather(run.state.params,
                                                                         tiled=True))
    if jax.process_index() == 0:
        leaves = {jax.tree_util.keystr(k): v
                  for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(args.out, **leaves)
        print("summary", summary["status"], summary["step"], flush=True)
    if jax.process_count() > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
