"""The pure, jitted train step: accumulation, in-step noise statistics, the optimizer update.

Letters: R data replicas (size of the mesh's `data` axis), m micro-batch per replica,
A accumulation steps, M = R·m the global micro-batch, B = A·M the logical batch, b the small
batch of the two-batch estimator, C chunks processed one after another, P parameters.

One step on a global batch [B, ...] sharded over `data`:

1. view it as C chunks [C, B/C] without moving data: each replica's B/R contiguous examples
   cut into C runs, chunk k = the k-th run of every replica (C = A: the micro-batches);
2. a `lax.scan` over the chunks with float32 accumulators: each chunk's gradient and, with
   the exact live estimate (default where `cbs.stats.ghost` reads the model), the sum of its
   examples' squared gradient norms Σ|g_i|² from the same backward pass; else its squared
   norm |g_small|² (or, per micro-batch, a `vmap` over the R replicas: b = m);
3. ḡ = the mean of the chunk gradients (the gradient of the mean loss over B), |ḡ|²;
4. the live estimate (`cbs.engine.live_noise`): exact tr(Σ) and |G|² of the whole batch from
   Σ_i |g_i|² and |ḡ|²; or the two-batch estimator (McCandlish et al. 2018, App. A;
   `cbs.stats.smoothing.two_batch`) from the mean of the B/b values |g_small|² and |ḡ|²;
   smoothed by `cbs.stats.smoothing.NoiseScaleEMA` in the state;
5. optionally, every `noise.every` steps, the measurement of `cbs.engine.measure` (the
   method the `NoiseSpec` names) on the first micro-batch(es), under `lax.cond` (or in
   `measure_now`, a separate jitted call); an exact B_simple measurement with an exact live
   estimate is that estimate (no extra pass);
6. u = direction(ḡ) (optax, `cbs.engine.optim`), θ ← θ − η·u with η = coupled_lr(η_0·s(E + B), B)
   (`cbs.engine.schedules`): the learning rate is a function of examples seen E, never of steps.

The two-batch estimate's small batches (`plan`): by default the A micro-batches when A ≥ 2
(free); else each replica's share when R ≥ 2; else two halves of the batch (C = 2: the one
case that changes the computation, by running the batch as two chunks). Splitting the logical batch
differently changes only the order of float32 sums, never the update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cbs.engine import live_noise, optim
from cbs.engine.counts import count_add, count_int32, count_value
from cbs.engine.lr import coupled_lr
from cbs.engine.measure import in_step_measurement, serves, step_measurement
from cbs.engine.noise_spec import NoiseSpec
from cbs.engine.step_metrics import StepMetrics
from cbs.stats import noise, smoothing
from cbs.stats.trees import tree_sq_norm

__all__ = [
    "StatefulLoss", "TrainState", "TrainStep", "init_train_state", "stateless",
]

PyTree = Any
# loss_fn(params, model_state, batch) -> (mean loss, new model_state)
StatefulLoss = Callable[[PyTree, PyTree, PyTree], tuple[jax.Array, PyTree]]



@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything on the device that an exact resume needs.

    step: int32 updates applied; examples_seen: examples consumed (E) as an exact two-word
    int32 count (`cbs.engine.counts`: exact to 2^61, where a plain int32 overflows at 2.1·10⁹);
    learning_rate: float32 η_0, the peak learning rate (a value, not a constant of the
    compiled step, so trials that differ only in η_0 share one compilation or one vmap);
    params, opt_state: model parameters and optax state; model_state: non-parameter model
    variables (BatchNorm statistics; empty otherwise); noise_ema:
    `cbs.stats.smoothing.NoiseScaleEMA` of the in-step live estimates; measure_ema: the same
    of the every-k-steps measurements (with the curvature pair when measured), which is what
    an adaptive schedule on b_noise reads.
    """

    step: jax.Array
    examples_seen: jax.Array
    learning_rate: jax.Array
    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    noise_ema: PyTree
    measure_ema: PyTree

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    TrainState, data_fields=[f.name for f in dataclasses.fields(TrainState)], meta_fields=[])


def init_train_state(params: PyTree, direction: optax.GradientTransformation, *,
                     learning_rate: float = 1.0, model_state: PyTree = None,
                     ema_decay: float = 0.95) -> TrainState:
    """A fresh state at step 0 (jittable: call under `jax.jit` to place it on a mesh)."""
    return TrainState(step=jnp.zeros((), jnp.int32), examples_seen=jnp.zeros((2,), jnp.int32),
                      learning_rate=jnp.asarray(learning_rate, jnp.float32),
                      params=params, opt_state=direction.init(params),
                      model_state={} if model_state is None else model_state,
                      noise_ema=smoothing.NoiseScaleEMA.init(decay=ema_decay),
                      measure_ema=smoothing.NoiseScaleEMA.init(decay=ema_decay))


def stateless(loss_fn: Callable[[PyTree, PyTree], jax.Array]) -> StatefulLoss:
    """Wraps loss_fn(params, batch) into the (params, model_state, batch) form."""
    return lambda params, model_state, batch: (loss_fn(params, batch), model_state)


def _mean_state(tree: PyTree) -> PyTree:
    """Mean over the leading (group) axis of float leaves; other leaves take group 0."""
    return jax.tree.map(lambda x: jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x[0], tree)


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStep:
    """`train_step(state, inputs, accum_steps) -> (state, metrics)`, jitted per accum count.

    Args:
      loss_fn: stateful loss (see `stateless`).
      direction: optax transformation without learning rate (`cbs.engine.optim.make_direction`).
      lr_fn: the schedule's shape s(E) (1 at the peak), jittable, of the examples seen
        including the current batch; η = state.learning_rate · s(E), then coupled to B.
      mesh: the device mesh; the batch is split over its `data` axis.
      state_sharding: pytree of NamedSharding like the state (in and out of the step).
      inputs_sharding: sharding (prefix) of the step's second argument.
      micro_batch: m, examples per replica per micro-batch.
      small_batch: b, examples per small batch of the two-batch estimator (see `plan`):
        M = R·m (the micro-batches), m with R ≥ 2 (each replica's share), or a multiple of R
        whose share b/R divides m (sub-batches); 0 = M when A ≥ 2, else m when R ≥ 2, else M/2.
      live: the live estimate of tr(Σ) and |G|² every step (`cbs.engine.live_noise`):
        "auto" (exact from the backward pass's per-example gradient norms where
        `cbs.stats.ghost` reads the model, else two-batch) | "exact" | "two_batch" | "none".
      two_batch: False turns every live estimate off (as live="none"; for speed comparisons).
      grad_norm: record |ḡ| as `opt/grad_norm` every step (the loop stops a run on a
        non-finite one). False skips the extra read of the gradient it costs when no live
        estimate needs |ḡ|² (live="none": 5–9 % of a 3 ms MLP step on XLA:CPU, see
        `benchmarks/train_step`); `opt/grad_norm` is then absent and a non-finite gradient
        shows as a non-finite loss one step later. With a live estimate it is recorded anyway.
      unroll: `lax.scan` unrolling of the chunk loop; 0 = automatic (see `_unroll`).
      batch_fn: batch_fn(inputs, examples_seen, batch_size) -> global batch, inside the jit
        (e.g. a gather of device-resident data at the stream's indices); None when the inputs
        are the batch.
      lr_coupling: (base_batch_size, rule, cap) for `cbs.engine.lr.coupled_lr`, or None.
      measure: the every-k-steps measurement of the step's examples (a
        `cbs.engine.noise_spec.NoiseSpec` with `every` > 0, its `batch_size` a multiple of
        R·m: 0 = one micro-batch), or None.
      seed: seeds the probe vectors (folded with the step).
    """

    loss_fn: StatefulLoss
    direction: optax.GradientTransformation
    lr_fn: Callable[[jax.Array], jax.Array]
    mesh: jax.sharding.Mesh
    state_sharding: PyTree
    inputs_sharding: PyTree = None
    micro_batch: int = 1
    small_batch: int = 0
    live: str = "auto"
    two_batch: bool = True
    grad_norm: bool = True
    unroll: int | bool = 0
    batch_fn: Callable[[PyTree, jax.Array, int], PyTree] | None = None
    lr_coupling: tuple[int, str, float | None] | None = None
    measure: NoiseSpec | None = None
    seed: int = 0
    data_axis: str = "data"
    _logged: set[str] = dataclasses.field(init=False, repr=False, compare=False)
    _kinds: dict[tuple, str] = dataclasses.field(init=False, repr=False, compare=False)
    _jit: Any = dataclasses.field(init=False, repr=False, compare=False)
    _measure_jit: Any = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.measure is not None and not self.measure.every:
            raise ValueError("TrainStep.measure: a NoiseSpec with every > 0, or None")
        live_noise.resolve(self.live, None)  # an unknown name fails here
        object.__setattr__(self, "_logged", set())
        object.__setattr__(self, "_kinds", {})
        out = (self.state_sharding, NamedSharding(self.mesh, P()))
        jit = jax.jit(self._packed_step, static_argnums=(2,), donate_argnums=(0,),
                      in_shardings=(self.state_sharding, self.inputs_sharding),
                      out_shardings=out)
        measure = jax.jit(self._measure_only, static_argnums=(2,),
                          in_shardings=(self.state_sharding, self.inputs_sharding),
                          out_shardings=(self.state_sharding.measure_ema,
                                         NamedSharding(self.mesh, P())))
        object.__setattr__(self, "_jit", jit)
        object.__setattr__(self, "_measure_jit", measure)

    # ------------------------------------------------------------------ public

    @property
    def replicas(self) -> int:
        return self.mesh.shape[self.data_axis]

    def batch_size(self, accum_steps: int) -> int:
        """B = A·R·m."""
        return accum_steps * self.replicas * self.micro_batch

    def measures_in_step(self) -> bool:
        return self.measure is not None and bool(self.measure.in_step)

    def live_kind(self, state: TrainState, inputs: PyTree, accum_steps: int) -> str:
        """The live estimator the step runs: "exact", "two_batch" or "none" (traces once per
        accumulation count and input shapes)."""
        key = (accum_steps, *((x.shape, x.dtype) for x in jax.tree.leaves(inputs)))
        if key not in self._kinds:
            out = []
            jax.eval_shape(lambda s, i: out.append(self._live(s, i, accum_steps)[0]), state,
                           inputs)
            self._kinds[key] = out[0]
        return self._kinds[key]

    def measured_in_step(self, state: TrainState, inputs: PyTree, accum_steps: int) -> bool:
        """Whether the step itself returns the every-k-steps measurement (in_step, or an exact
        B_simple measurement that the exact live statistics of the step's batch give for free),
        so that `measure_now` need not run."""
        return self.measures_in_step() or (
            serves(self.measure, self.live_kind(state, inputs, accum_steps)))

    def __call__(self, state: TrainState, inputs: PyTree, accum_steps: int
                 ) -> tuple[TrainState, StepMetrics]:
        """One update; `state` is donated. Metrics stay on the device (read them later):
        a `StepMetrics` mapping of the names of `apply`'s dict to scalars."""
        return self._jit(state, inputs, accum_steps)

    def apply(self, state: TrainState, inputs: PyTree, accum_steps: int
              ) -> tuple[TrainState, dict[str, jax.Array]]:
        """The same step, pure and unjitted, for use under the caller's jit, vmap or scan
        (e.g. several learning rates as one vmapped state)."""
        return self._step(state, inputs, accum_steps)

    def measure_now(self, state: TrainState, inputs: PyTree, accum_steps: int
                    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """The `noise/*` measurement alone, on the examples the step would use; returns the
        state with `measure_ema` updated (nothing is donated) and the metrics."""
        ema, metrics = self._measure_jit(state, inputs, accum_steps)
        return state.replace(measure_ema=ema), metrics

    def num_compilations(self) -> int:
        """Distinct compiled variants of the step so far (one per accumulation count)."""
        return self._jit._cache_size()

    # ------------------------------------------------------------------ internals

    def plan(self, accum_steps: int) -> tuple[str, int, int]:
        """(kind, b, C) of the two-batch estimate for A accumulation steps.

        kind "split": the batch is processed as C = B/b sequential chunks of b examples
        (b/R per replica; C = A when b = M) and the chunks are the small batches;
        kind "replica": C = A micro-batches, each replica's m examples a small batch (a vmap
        over the R replicas, no extra communication); kind "none": no estimate, C = A.
        """
        r, m, a = self.replicas, self.micro_batch, accum_steps
        b = self.small_batch or (r * m if a >= 2 else m if r >= 2 else m // 2 * (1 - m % 2))
        if not self.two_batch or self.live == "none" or b < 1 or b >= a * r * m:
            return "none", a * r * m, a
        if b == m and r >= 2:
            return "replica", b, a
        if not live_noise.small_batch_ok(b, r, m):
            raise ValueError(f"small_batch={b} must be M = R·m = {r * m}, m = {m} (R ≥ 2), or"
                             f" a multiple of R = {r} whose share b/R divides m")
        return "split", b, a * r * m // b

    def _unroll(self, chunks: int) -> int | bool:
        """Scan unrolling: `unroll` when set; else full on CPU up to 16 chunks, because
        XLA:CPU runs convolutions inside a while loop several times slower (a small CNN: 4×
        here), and rolled elsewhere (one copy of the body, least memory and compile time)."""
        if self.unroll:
            return self.unroll
        on_cpu = self.mesh.devices.flat[0].platform == "cpu"
        return True if on_cpu and chunks <= 16 else 1

    def _chunks(self, state: TrainState, inputs: PyTree, accum_steps: int, chunks: int):
        """The global batch [B, ...] as [C, B/C, ...]: replica r's contiguous B/R examples cut
        into C runs, chunk k = the k-th run of every replica (no data moves)."""
        r, a, m = self.replicas, accum_steps, self.micro_batch
        batch = inputs if self.batch_fn is None else self.batch_fn(
            inputs, count_int32(state.examples_seen), a * r * m)
        spec = NamedSharding(self.mesh, P(None, self.data_axis))

        def view(x):
            n, rest = x.shape[0], x.shape[1:]
            if n != a * r * m:
                raise ValueError(f"batch has {n} examples, expected A·R·m = {a}·{r}·{m}")
            x = x.reshape(r, chunks, n // (r * chunks), *rest).swapaxes(0, 1)
            return jax.lax.with_sharding_constraint(x.reshape(chunks, n // chunks, *rest), spec)

        return jax.tree.map(view, batch)

    def _chunk_grad(self, params, model_state, chunk, kind: str):
        """Mean loss, mean gradient (float32), new model state, Σ_groups |g_group|² (kind
        "exact": Σ_i |g_i|² over the chunk's examples, the model state unchanged)."""
        if kind == "exact":
            loss, grads, sq = live_noise.value_grad_sq_sum(self.loss_fn, params, model_state,
                                                           chunk)
            return loss, grads, model_state, sq
        value_and_grad = jax.value_and_grad(self.loss_fn, has_aux=True)
        f32 = lambda t: jax.tree.map(lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)),
                                     t)
        if kind != "replica":
            (loss, model_state), grads = value_and_grad(params, model_state, chunk)
            grads = f32(grads)
            sq = tree_sq_norm(grads) if kind == "split" else jnp.zeros((), jnp.float32)
            return loss, grads, model_state, sq
        r = self.replicas  # one group per replica: the per-replica gradients before the mean
        spec = NamedSharding(self.mesh, P(self.data_axis))
        chunk_R = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x.reshape(r, x.shape[0] // r, *x.shape[1:]), spec), chunk)
        (loss_R, state_R), grads_R = jax.vmap(value_and_grad, in_axes=(None, None, 0))(
            params, model_state, chunk_R)
        grads_R = f32(grads_R)
        sq_R = sum(jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim)))
                   for g in jax.tree.leaves(grads_R))
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads_R)
        return jnp.mean(loss_R), grads, _mean_state(state_R), jnp.sum(sq_R)

    def _accumulate(self, params, model_state, chunks, kind: str):
        """Loss, ḡ and Σ|g_small|² over the C chunks (a scan with float32 accumulators)."""
        if jax.tree.leaves(chunks)[0].shape[0] == 1:
            return self._chunk_grad(params, model_state, jax.tree.map(lambda x: x[0], chunks),
                                    kind)

        def body(carry, chunk):
            loss_sum, grad_sum, state, sq_sum = carry
            loss, grads, state, sq = self._chunk_grad(params, state, chunk, kind)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (loss_sum + loss, grad_sum, state, sq_sum + sq), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype,
                                                                            jnp.float32)), params)
        acc = jnp.zeros((), jnp.result_type(float))
        init = (jnp.zeros((), jnp.float32), zeros, model_state, acc)
        c = jax.tree.leaves(chunks)[0].shape[0]
        (loss_sum, grad_sum, model_state, sq_sum), _ = jax.lax.scan(
            body, init, chunks, unroll=self._unroll(c))
        return loss_sum / c, jax.tree.map(lambda g: g / c, grad_sum), model_state, sq_sum

    def _noise_metrics(self, state: TrainState, chunks, per_micro: int, whole=None
                       ) -> tuple[PyTree, dict[str, jax.Array]]:
        """(measure_ema, noise/* metrics) of `cbs.engine.measure.step_measurement`."""
        loss_fn = lambda p, b: self.loss_fn(p, state.model_state, b)[0]
        assert self.measure is not None  # only called when the step measures
        return step_measurement(self.measure, loss_fn, state, chunks, per_micro,
                                self.micro_batch * self.replicas, seed=self.seed, whole=whole)

    def _packed_step(self, state: TrainState, inputs: PyTree, accum_steps: int):
        state, metrics = self._step(state, inputs, accum_steps)
        return state, StepMetrics.pack(metrics)

    def _measure_only(self, state: TrainState, inputs: PyTree, accum_steps: int):
        _, _, c = self.plan(accum_steps)
        chunks = self._chunks(state, inputs, accum_steps, c)
        return self._noise_metrics(state, chunks, c // accum_steps)

    def _learning_rate(self, state: TrainState, batch_size: int) -> jax.Array:
        lr = state.learning_rate * self.lr_fn(count_value(count_add(state.examples_seen,
                                                                    batch_size)))
        if self.lr_coupling is not None:
            base, rule, cap = self.lr_coupling
            lr = coupled_lr(lr, batch_size, base, rule, cap)
        return jnp.asarray(lr, jnp.float32)

    def _live(self, state: TrainState, inputs: PyTree, accum_steps: int
              ) -> tuple[str, str | None]:
        """(estimator, why not exact) for this step's shapes; logged once per estimator."""
        if not self.two_batch or self.live == "none" or self.batch_size(accum_steps) < 2:
            return "none", None
        reason = None
        if self.live != "two_batch":
            chunks = self._chunks(state, inputs, accum_steps, accum_steps)
            chunk = jax.tree.map(lambda x: x[0], chunks)
            reason = live_noise.ghost_unavailable(self.loss_fn, state.params, state.model_state,
                                                  chunk)
        kind = live_noise.resolve(self.live, reason)
        if kind == "two_batch" and self.plan(accum_steps)[0] == "none":
            kind = "none"
        if kind not in self._logged:
            self._logged.add(kind)
            live_noise.log_choice(kind, reason)
        return kind, reason

    def _step(self, state: TrainState, inputs: PyTree, accum_steps: int):
        b_big = self.batch_size(accum_steps)
        live, _ = self._live(state, inputs, accum_steps)
        if live == "exact":
            kind, c = "exact", accum_steps
        else:
            kind, b_small, c = self.plan(accum_steps)
        chunks = self._chunks(state, inputs, accum_steps, c)
        loss, grads, model_state, small_sq = self._accumulate(
            state.params, state.model_state, chunks, kind)
        ema = state.noise_ema
        # |ḡ|²: every live estimate needs it; without one, only `opt/grad_norm` reads it
        big_sq = tree_sq_norm(grads) if kind != "none" or self.grad_norm else None
        if kind == "none" or big_sq is None:
            grad_sq_norm = trace_sigma = jnp.full((), jnp.nan, jnp.float32)
        elif kind == "exact":
            grad_sq_norm, trace_sigma = live_noise.exact_stats(small_sq, big_sq, b_big)
        else:
            groups = c * (self.replicas if kind == "replica" else 1)
            grad_sq_norm, trace_sigma = smoothing.two_batch(small_sq / groups, big_sq, b_small,
                                                        b_big)
        if kind != "none":
            ema = ema.update(grad_sq_norm, trace_sigma)
        f32 = lambda x: jnp.asarray(x, jnp.float32)
        metrics = {"train/loss": f32(loss)}
        if big_sq is not None:
            metrics["opt/grad_norm"] = f32(jnp.sqrt(big_sq))
        metrics |= {"noise/live_grad_sq_norm": f32(grad_sq_norm),
                    "noise/live_trace_sigma": f32(trace_sigma),
                    "noise/live_exact": f32(kind == "exact"),
                    "noise/ema_grad_sq_norm": f32(ema.grad_sq_norm),
                    "noise/ema_trace_sigma": f32(ema.trace_sigma),
                    "noise/ema_b_simple": f32(ema.b_simple)}
        exact = None
        if live == "exact" and big_sq is not None:
            exact = noise.NoiseStats(b_big, big_sq, grad_sq_norm, trace_sigma,
                                     trace_sigma / grad_sq_norm)
        measure_ema, measured = in_step_measurement(
            self.measure, state.step, state.measure_ema, exact,
            lambda whole: self._noise_metrics(state, chunks, c // accum_steps, whole),
            served=serves(self.measure, live), in_step=self.measures_in_step())
        metrics |= measured
        updates, opt_state = self.direction.update(grads, state.opt_state, state.params)
        examples_after = count_add(state.examples_seen, b_big)
        lr = self._learning_rate(state, b_big)
        metrics["opt/lr"] = lr
        params = optim.apply_step(state.params, updates, lr)
        new_state = state.replace(step=state.step + 1, examples_seen=examples_after,
                                  params=params, opt_state=opt_state, model_state=model_state,
                                  noise_ema=ema, measure_ema=measure_ema)
        return new_state, metrics
