"""The training config: defaults with every field documented, and validation at start-up.

`default_config()` is the full schema (units in the trailing comments); the presets in
`cbs.configs` start from it. `validate(config, data_replicas=R)` runs before anything is
compiled and raises `ConfigError` (a ValueError) whose message starts with the dotted name of
the offending field. Each component checks its own section (docs/design.md, "Config
validation"); `validate` runs them and keeps the checks that join sections.

Letters: R data replicas, m micro-batch per replica, B logical batch = A·R·m.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from cbs import data, models
from cbs.engine import live_noise, loop, lr, noise_spec, optim, schedules
from cbs.runtime import fields, mesh, throughput
from cbs.runtime.fields import ConfigError

__all__ = ["batch_sizes", "default_config", "validate"]


def default_config() -> ml_collections.ConfigDict:
    """Every field the engine reads, with its default."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds parameter init, the data order and the probe vectors

    c.data = ml_collections.ConfigDict()
    c.data.name = "digits"  # dataset name in the cbs.data registry
    c.data.options = ml_collections.ConfigDict()  # extra keyword arguments of get_dataset

    c.model = models.default_model_config("mlp")  # fields: cbs.models.default_model_config

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adam"  # "sgd" | "momentum" | "adam" | "adamw"
    c.optim.learning_rate = 1e-3  # peak η_0 at batch.lr_coupling.base_batch_size
    c.optim.momentum = 0.9  # heavy-ball coefficient ("momentum" only)
    c.optim.nesterov = False  # Nesterov momentum ("momentum" only)
    c.optim.b1 = 0.9  # Adam first-moment decay
    c.optim.b2 = 0.999  # Adam second-moment decay
    c.optim.eps = 1e-8  # Adam denominator epsilon
    c.optim.weight_decay = 0.0  # L2 (sgd, momentum, adam) or decoupled (adamw) coefficient
    c.optim.weight_decay_mask = "matrices"  # "matrices" (ndim ≥ 2 only) | "all"
    c.optim.clip_norm = 0.0  # clip the mean gradient to this global norm; 0 = off
    c.optim.warmup_examples = 0  # linear warmup length, in examples seen
    c.optim.decay = "constant"  # after warmup: "constant" | "cosine" | "linear"
    c.optim.total_examples = 0  # end of the decay, in examples; 0 = train.max_examples
    c.optim.final_fraction = 0.0  # η at the end of the decay, as a fraction of η_0

    c.batch = ml_collections.ConfigDict()
    c.batch.micro_batch = 32  # m: examples per replica per micro-batch (fixed for a run)
    c.batch.schedule = ml_collections.ConfigDict()  # see schedules.batch_schedule_from_config
    c.batch.schedule.kind = "constant"  # "constant" | "step" | "linear" | "adaptive"
    c.batch.schedule.batch_size = 128  # B for "constant" (examples per update)
    c.batch.adapt_every = 10  # adaptive schedule: steps between noise-scale observations
    c.batch.lr_coupling = ml_collections.ConfigDict()
    c.batch.lr_coupling.rule = "none"  # η·(B/B_0)^p: "none" p=0 | "linear" p=1 | "sqrt" p=1/2
    c.batch.lr_coupling.base_batch_size = 0  # B_0; 0 = the initial batch size
    c.batch.lr_coupling.cap = 0.0  # largest learning rate allowed; 0 = no cap

    c.noise = ml_collections.ConfigDict()
    c.noise.live = "auto"  # live estimate of tr(Σ), |G|² (+ EMA) every step: "auto" (exact
    #   where cbs.stats.ghost reads the model, else two-batch) | "exact" | "two_batch" | "none"
    c.noise.two_batch = True  # False: no live estimate at all (as live="none")
    c.noise.small_batch = 0  # the two-batch estimate's small batch b (cbs.engine.step); 0 =
    #   R·m if A ≥ 2, m if R ≥ 2, else m/2
    c.noise.ema_decay = 0.95  # decay of the NoiseScaleEMA (per step)
    c.noise.advice_calibration = ""  # the calibration file of the live advice/* keys: "" the
    #   shipped one; a path: e.g. cbs-advise --probe's calibration_STEP.json
    # The measurement (cbs.engine.noise_spec.NoiseSpec, measured by cbs.engine.measure):
    c.noise.every = 0  # steps between measurements of the step's examples; 0 = never
    c.noise.examples = "step"  # also measured at each evaluation: "stream" | "all" | "auto"
    #   (cbs.engine.noise_spec); "step": only every noise.every steps
    c.noise.method = "auto"  # a registered method (cbs.stats.noise.register_method): "auto"
    #   | "fast" | "vmap" (exact) | "probe" (Hutchinson) | "sampled" | "full_data"
    c.noise.batch_size = 0  # n, examples measured; of the step's: a multiple of R·m, 0 = one
    #   micro-batch (or the whole batch B, read from an exact live estimate); of a stream's:
    #   0 = no measurement
    c.noise.curvature = False  # also measure tr(HΣ), GᵀHG and b_noise
    c.noise.deviations = 0  # m, examples whose deviations give tr(HΣ) ("sampled",
    #   "full_data"); 0 = all measured (of a stream's, the first m of n)
    c.noise.hessian_batch_size = 0  # h, independent examples whose Hessian gives tr(HΣ)
    #   (examples "stream"; "all": 0 = all N)
    c.noise.num_probes = 1  # probe vectors per measurement ("probe" only)
    c.noise.chunk_size = 0  # examples per vmap chunk in exact; 0 = all at once
    c.noise.in_step = False  # measure in a step variant (True) or in its own jit call (False:
    #   cheaper on CPU, benchmarks/train_step.py: +11 % vs +57 % for a CNN at every=10)

    c.train = ml_collections.ConfigDict()
    c.train.max_steps = 1000  # stop after this many updates (0 = no step limit)
    c.train.max_examples = 0  # stop once this many examples are seen (0 = no limit)
    c.train.log_every = 10  # read metrics from the device every this many steps
    c.train.record_every = 1  # write a train record for every this-many-th step
    c.train.checkpoint_every = 500  # steps between checkpoints (one is also saved at exit)
    c.train.keep_checkpoints = 2  # most recent checkpoints kept on disk
    c.train.divergence_factor = 10.0  # diverged when the batch loss stays above this × the
    #   initial loss (0 = off; a non-finite loss or gradient always counts as diverged)
    c.train.divergence_patience = 3  # ... for this many consecutive steps (not a short spike)
    # c.train.grad_norm (optional, absent by default so that existing runs keep their config
    #   hash; True when absent): record |ḡ| as opt/grad_norm every step and stop on a
    #   non-finite one (docs/guides/training.md: what False saves with noise.live "none").
    c.train.progress_bar = True  # tqdm bar with loss and examples/s (process 0)
    c.train.tensorboard = False  # TensorBoard events in workdir/tensorboard (process 0;
    #   needs the [tensorboard] extra, checked before anything is written)
    c.train.wandb = ""  # W&B project to mirror the records to ("" = none; process 0; needs
    #   the [wandb] extra; entity, offline mode and directory from WANDB_ENTITY, WANDB_MODE,
    #   WANDB_DIR). Counts in the config hash only when set

    c.eval = ml_collections.ConfigDict()
    c.eval.enabled = True  # evaluate at all (every eval.every steps and at the end of the run)
    c.eval.every = 0  # steps between evaluations; 0 = only at the end
    # c.eval.steps (optional, absent by default so that existing runs keep their config
    #   hash): steps after which to evaluate (increasing), instead of eval.every; a sweep
    #   trial's log-spaced grid (`RunOverrides.eval_steps`); and at the end
    c.eval.batch_size = 1024  # examples per evaluation chunk (rounded up to a multiple of R)
    c.eval.num_examples = 0  # evaluation-split examples used (the first n); 0 = all
    c.eval.full_train = True  # also evaluate the loss on the whole training set (in memory)
    c.eval.train_examples = 0  # training examples in that evaluation (the first n); 0 = all

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # devices on the data axis; -1 = all devices / model
    c.mesh.model = 1  # devices on the model axis (parameter sharding)
    c.mesh.param_mode = "replicated"  # "replicated" | "fsdp" | "model" (mesh.param_shardings)
    #   | "fsdp_tp" | "tp" (by parameter name, mesh.LM_RULES: FSDP over data × TP over model)

    c.perf = ml_collections.ConfigDict()  # cbs.runtime.throughput
    c.perf.records = False  # add perf/* to train records: tokens/s, examples/s, step time, MFU
    c.perf.peak_flops = 0.0  # peak FLOP/s of one device for MFU; 0 = from the device table
    c.perf.profile_start = -1  # first step of a jax.profiler trace (workdir/profile); -1 = off
    c.perf.profile_steps = 5  # steps in the trace window
    c.perf.compilation_cache_dir = ""  # persistent XLA compilation cache; "" = off
    return c


def _section(config: Any, name: str) -> Any:
    return fields.get(config, name, "config")


def batch_sizes(config: Any) -> tuple[int, ...]:
    """Every batch size the configured schedule can produce (for validation and planning)."""
    return schedules.checked_schedule(config.batch.schedule).batch_sizes()


def validate(config: Any, *, data_replicas: int, model_names: tuple[str, ...] | None = None,
             dataset_names: tuple[str, ...] | None = None) -> noise_spec.NoiseSpec:
    """Checks every field the engine reads; raises ConfigError naming the first bad one.
    Returns the noise section read once (`NoiseSpec`). data_replicas: R (every batch size must
    be a multiple of R·m); model_names / dataset_names: the known names, when given."""
    fields.integer(config, "seed", "config", minimum=0)
    if dataset_names is not None:
        fields.choice(config, "data.name", "config", tuple(dataset_names))
        if config.data.name in data.known_datasets():
            try:
                data.validate_config(config.data)
            except ValueError as err:
                raise ConfigError(str(err)) from err
    if model_names is not None:
        fields.choice(config, "model.name", "config", tuple(model_names))
    optim.validate_config(_section(config, "optim"),
                          max_examples=fields.integer(config, "train.max_examples", "config",
                                                      minimum=0))
    schedule = schedules.validate_batch_config(_section(config, "batch"),
                                               optimizer=str(config.optim.name))
    lr.validate_coupling_config(_section(config, "batch.lr_coupling"))
    spec = noise_spec.NoiseSpec.from_config(_section(config, "noise"))
    loop.validate_train_config(_section(config, "train"))
    loop.validate_eval_config(_section(config, "eval"))
    mesh.validate_config(_section(config, "mesh"))
    if "perf" in config:
        throughput.validate_config(config.perf)
    _check_sizes(config, data_replicas, schedule, spec)
    return spec


def _check_sizes(config: Any, replicas: int, schedule: schedules.BatchSchedule,
                 n: noise_spec.NoiseSpec) -> None:
    """The checks that join sections (module docstring)."""
    m, r = config.batch.micro_batch, replicas
    multiple, sizes = m * r, schedule.batch_sizes()
    for b in sizes:
        if b < 1 or b % multiple:
            raise ConfigError(f"config.batch.schedule: batch size {b} is not a positive multiple"
                              f" of micro_batch × data replicas = {m} × {r}")
    if schedule.observes == "b_noise" and not (n.every and n.curvature):
        raise ConfigError("config.batch.schedule.source: 'b_noise' needs curvature "
                          "measurements (noise.every > 0 and noise.curvature=True)")
    b = n.small_batch
    if b and not live_noise.small_batch_ok(b, r, m):
        raise ConfigError(f"config.noise.small_batch: {b} must be micro_batch × data replicas ="
                          f" {multiple}, micro_batch = {m} (replicas ≥ 2), or a multiple of the"
                          f" {r} replicas whose share divides micro_batch")
    if n.every and n.batch_size and (n.batch_size % multiple or n.batch_size > min(sizes)):
        raise ConfigError(f"config.noise.batch_size: {n.batch_size} must be a multiple of "
                          f"micro_batch × data replicas = {multiple} and at most the smallest "
                          f"batch {min(sizes)}")
    if n.every and (n.batch_size or multiple) < 2:
        raise ConfigError("config.noise.batch_size: a measurement needs at least 2 examples")
