"""The pure, jitted train step: accumulation, the live noise estimate, the optimizer update.

Letters: R data replicas (size of the mesh's `data` axis), m micro-batch per replica,
A accumulation steps, M = R·m the global micro-batch, B = A·M the logical batch, b the small
batch of the two-batch estimator, C chunks processed one after another, P parameters.

One step on a global batch [B, ...] sharded over `data` (`TrainStep.apply`, top to bottom):

1. view it as C chunks [C, B/C] without moving data (`_chunks`; C = A: the micro-batches);
2. a `lax.scan` over the chunks with float32 accumulators: each chunk's gradient and, with
   the exact live estimate, Σ|g_i|² over its examples from the same backward pass; else its
   squared norm |g_small|² (or, per micro-batch, a `vmap` over the R replicas: b = m);
3. ḡ = the mean of the chunk gradients (the gradient of the mean loss over B), |ḡ|²;
4. the live estimate (`cbs.engine.live_noise`), smoothed by `NoiseScaleEMA` in the state;
5. the caller's `measure` hook, if any (`cbs.engine.measure.Measurement`);
6. u = direction(ḡ) (`cbs.engine.optim`), θ ← θ − η·u with η = lr_fn(η_0, E + B, B)
   (`cbs.engine.lr.step_rate`): a function of examples seen E, never of steps.

The two-batch estimate's small batches (`_plan`): by default the A micro-batches when A ≥ 2
(free); else each replica's share when R ≥ 2; else two halves of the batch (C = 2: the one
case that changes the computation). Splitting the logical batch differently changes only the
order of float32 sums, never the update.
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

from cbs.engine import live_noise
from cbs.engine.state import (
    StatefulLoss,
    StepMetrics,
    TrainState,
    count_add,
    count_int32,
    count_value,
)
from cbs.stats import noise, smoothing
from cbs.stats.trees import tree_sq_norm

__all__ = ["BatchLayout", "MeasureHook", "StepOptions", "TrainStep", "apply_step", "jit_step"]

PyTree = Any
# measure(state, chunks [C, B/C, ...], C/A, exact NoiseStats of the batch or None)
#   -> (measure_ema, {metric: scalar}): run inside the step before the update
MeasureHook = Callable[[TrainState, PyTree, int, "noise.NoiseStats | None"],
                       tuple[smoothing.NoiseScaleEMA, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where the step's batch comes from and how it lies on the mesh (the batch split over
    its `data_axis`). batch_fn(inputs, examples_seen, batch_size) -> global batch, inside the
    jit (e.g. a gather of device-resident data); None when the inputs are the batch."""

    mesh: jax.sharding.Mesh
    state_sharding: PyTree  # NamedShardings like the state (in and out of the step)
    inputs_sharding: PyTree = None  # sharding (prefix) of the step's second argument
    micro_batch: int = 1  # m
    batch_fn: Callable[[PyTree, jax.Array, int], PyTree] | None = None
    data_axis: str = "data"

    @property
    def replicas(self) -> int:
        return self.mesh.shape[self.data_axis]

    def batch_size(self, accum_steps: int) -> int:
        """B = A·R·m."""
        return accum_steps * self.replicas * self.micro_batch


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the step estimates its noise and runs its chunks."""

    live: str = "auto"  # "auto" (exact where it can) | "exact" | "two_batch" | "none"
    small_batch: int = 0  # b of the two-batch estimator (`_plan`); 0 = automatic
    grad_norm: bool = True  # record |ḡ| as `opt/grad_norm` (always with a live estimate)


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStep:
    """`train_step(state, inputs, accum_steps) -> (state, metrics)`, jitted per accum count.

    Args:
      loss_fn: stateful loss (`cbs.engine.state.stateless` wraps a plain one).
      direction: optax transformation without learning rate (`cbs.engine.optim.make_direction`).
      lr_fn: lr_fn(η_0, E, B) -> η, jittable, of the state's peak rate η_0, the examples seen
        E including the current batch and the batch size B (`cbs.engine.lr.step_rate`).
    """

    loss_fn: StatefulLoss
    direction: optax.GradientTransformation
    lr_fn: Callable[[jax.Array, jax.Array, int], jax.Array]
    layout: BatchLayout
    options: StepOptions = StepOptions()
    _logged: set[str] = dataclasses.field(default_factory=set, init=False, repr=False)
    _kinds: dict[tuple, str] = dataclasses.field(default_factory=dict, init=False, repr=False)
    _jit: Any = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        live_noise.resolve(self.options.live, None)  # an unknown name fails here
        object.__setattr__(self, "_jit", jit_step(self))

    def __call__(self, state: TrainState, inputs: PyTree, accum_steps: int
                 ) -> tuple[TrainState, StepMetrics]:
        """One update; `state` is donated. Metrics stay on the device (`StepMetrics`)."""
        return self._jit(state, inputs, accum_steps)

    def num_compilations(self) -> int:
        """Distinct compiled variants of the step so far (one per accumulation count)."""
        return self._jit._cache_size()

    def live_kind(self, state: TrainState, inputs: PyTree, accum_steps: int) -> str:
        """The live estimator the step runs: "exact", "two_batch" or "none" (traces once per
        accumulation count and input shapes)."""
        key = (accum_steps, *((x.shape, x.dtype) for x in jax.tree.leaves(inputs)))
        if key not in self._kinds:
            out = []
            jax.eval_shape(lambda s, i: out.append(self._live(s, i, accum_steps)), state, inputs)
            self._kinds[key] = out[0]
        return self._kinds[key]

    def apply(self, state: TrainState, inputs: PyTree, accum_steps: int,
              measure: MeasureHook | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
        """The step, pure and unjitted, for the caller's jit, vmap or scan; `measure` runs on the
        step's examples before the update and its metrics join the step's."""
        b_big = self.layout.batch_size(accum_steps)
        live = self._live(state, inputs, accum_steps)
        kind, b_small, c = (("exact", b_big, accum_steps) if live == "exact"
                            else self._plan(accum_steps))
        chunks = self._chunks(state, inputs, accum_steps, c)
        loss, grads, model_state, small_sq = self._accumulate(
            state.params, state.model_state, chunks, kind)
        # |ḡ|²: every live estimate needs it; without one, only `opt/grad_norm` reads it
        big_sq = tree_sq_norm(grads) if kind != "none" or self.options.grad_norm else None
        if kind == "none" or big_sq is None:
            grad_sq_norm = trace_sigma = jnp.full((), jnp.nan, jnp.float32)
        elif kind == "exact":
            grad_sq_norm, trace_sigma = live_noise.exact_stats(small_sq, big_sq, b_big)
        else:
            groups = c * (self.layout.replicas if kind == "replica" else 1)
            grad_sq_norm, trace_sigma = smoothing.two_batch(small_sq / groups, big_sq,
                                                            b_small, b_big)
        ema = state.noise_ema
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
        measure_ema = state.measure_ema
        if measure is not None:
            exact = None if kind != "exact" or big_sq is None else noise.NoiseStats(
                b_big, big_sq, grad_sq_norm, trace_sigma, trace_sigma / grad_sq_norm)
            measure_ema, measured = measure(state, chunks, c // accum_steps, exact)
            metrics |= measured
        updates, opt_state = self.direction.update(grads, state.opt_state, state.params)
        seen = count_add(state.examples_seen, b_big)
        lr = jnp.asarray(self.lr_fn(state.learning_rate, count_value(seen), b_big), jnp.float32)
        metrics["opt/lr"] = lr
        new_state = state.replace(step=state.step + 1, examples_seen=seen,
                                  params=apply_step(state.params, updates, lr),
                                  opt_state=opt_state, model_state=model_state,
                                  noise_ema=ema, measure_ema=measure_ema)
        return new_state, metrics

    # ------------------------------------------------------------------ internals

    def _plan(self, accum_steps: int) -> tuple[str, int, int]:
        """(kind, b, C) of the two-batch estimate for A accumulation steps. "split": C = B/b
        sequential chunks of b examples (b/R per replica; C = A when b = M), the small
        batches; "replica": C = A micro-batches, each replica's m examples a small batch (a
        vmap over the R replicas, no extra communication); "none": no estimate, C = A."""
        r, m, a = self.layout.replicas, self.layout.micro_batch, accum_steps
        b = self.options.small_batch or (r * m if a >= 2 else m if r >= 2
                                         else m // 2 * (1 - m % 2))
        if self.options.live == "none" or b < 1 or b >= a * r * m:
            return "none", a * r * m, a
        if b == m and r >= 2:
            return "replica", b, a
        if not live_noise.small_batch_ok(b, r, m):
            raise ValueError(f"small_batch={b} must be M = R·m = {r * m}, m = {m} (R ≥ 2), or"
                             f" a multiple of R = {r} whose share b/R divides m")
        return "split", b, a * r * m // b

    def _chunks(self, state: TrainState, inputs: PyTree, accum_steps: int, chunks: int):
        """The global batch [B, ...] as [C, B/C, ...]: replica r's contiguous B/R examples cut
        into C runs, chunk k = the k-th run of every replica (no data moves)."""
        lay = self.layout
        r, a, m = lay.replicas, accum_steps, lay.micro_batch
        batch = inputs if lay.batch_fn is None else lay.batch_fn(
            inputs, count_int32(state.examples_seen), a * r * m)
        spec = NamedSharding(lay.mesh, P(None, lay.data_axis))

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
        r = self.layout.replicas  # one group per replica: the per-replica gradients
        spec = NamedSharding(self.layout.mesh, P(self.layout.data_axis))
        chunk_R = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x.reshape(r, x.shape[0] // r, *x.shape[1:]), spec), chunk)
        (loss_R, state_R), grads_R = jax.vmap(value_and_grad, in_axes=(None, None, 0))(
            params, model_state, chunk_R)
        grads_R = f32(grads_R)
        sq_R = sum(jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim)))
                   for g in jax.tree.leaves(grads_R))
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads_R)
        # the model state: mean over the replicas of float leaves, replica 0's otherwise
        mean_state = jax.tree.map(lambda x: jnp.mean(x, axis=0)
                                  if jnp.issubdtype(x.dtype, jnp.floating) else x[0], state_R)
        return jnp.mean(loss_R), grads, mean_state, jnp.sum(sq_R)

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
        # unrolled on CPU up to 16 chunks: XLA:CPU runs convolutions inside a while loop several
        # times slower (a small CNN: 4× here); rolled elsewhere (least memory and compile time)
        on_cpu = self.layout.mesh.devices.flat[0].platform == "cpu"
        (loss_sum, grad_sum, model_state, sq_sum), _ = jax.lax.scan(
            body, init, chunks, unroll=True if on_cpu and c <= 16 else 1)
        return loss_sum / c, jax.tree.map(lambda g: g / c, grad_sum), model_state, sq_sum

    def _live(self, state: TrainState, inputs: PyTree, accum_steps: int) -> str:
        """The estimator for this step's shapes; logged once per estimator."""
        live = self.options.live
        if live == "none" or self.layout.batch_size(accum_steps) < 2:
            return "none"
        reason = None
        if live != "two_batch":
            chunks = self._chunks(state, inputs, accum_steps, accum_steps)
            chunk = jax.tree.map(lambda x: x[0], chunks)
            reason = live_noise.ghost_unavailable(self.loss_fn, state.params, state.model_state,
                                                  chunk)
        kind = live_noise.resolve(live, reason)
        if kind == "two_batch" and self._plan(accum_steps)[0] == "none":
            kind = "none"
        if kind not in self._logged:
            self._logged.add(kind)
            live_noise.log_choice(kind, reason)
        return kind


def jit_step(train_step: TrainStep, measure: MeasureHook | None = None
             ) -> Callable[[TrainState, PyTree, int], tuple[Any, Any]]:
    """`train_step.apply` with the hook `measure`, jitted with the layout's shardings, A
    static, metrics packed (`StepMetrics`) and the state donated."""
    lay = train_step.layout

    def packed(state: TrainState, inputs: PyTree, accum_steps: int):
        state, metrics = train_step.apply(state, inputs, accum_steps, measure)
        return state, StepMetrics.pack(metrics)

    return jax.jit(packed, static_argnums=(2,), donate_argnums=(0,),
                   in_shardings=(lay.state_sharding, lay.inputs_sharding),
                   out_shardings=(lay.state_sharding, NamedSharding(lay.mesh, P())))


def apply_step(params, updates, lr: jax.Array):
    """θ − η·u, leaf by leaf, keeping each parameter's dtype (as `optax.apply_updates`)."""
    return jax.tree.map(
        lambda p, u: (p - lr.astype(u.dtype) * u).astype(p.dtype) if p is not None else None,
        params, updates, is_leaf=lambda x: x is None)
