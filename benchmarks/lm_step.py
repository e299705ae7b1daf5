"""Train-step throughput of the scanned LM (`cbs.models.lm`): tokens/s, MFU, compile time and
memory, with and without the in-step noise estimate and a periodic exact measurement.

    python -m benchmarks.lm_step --tiny          # CPU smoke run (seconds; the default suite
                                                 # runs it through tests/test_throughput.py)
    python -m benchmarks.lm_step                 # the sizes that fit the device (GPU/TPU)
    python -m benchmarks.lm_step --sizes=124m --batch=16 --seq_len=1024 --remat=dots
    python -m benchmarks.lm_step --sizes=124m --variants=plain --profile=/tmp/prof
                                                 # + a jax.profiler trace of the plain step
                                                 # and its top kernels by device time
    python -m benchmarks.lm_step --sizes=124m --variants=plain,live \
        --tied_forms=materialised,auto,gram,direct  # the tied embedding's norms each way

On all local devices (data parallel, FSDP × TP by name when --model_axis > 1), AdamW, one fixed
device-resident batch of B sequences of T tokens (vocabulary 50304), A = 2 accumulation
steps. Variants:
- `plain`: `cbs.engine.step.TrainStep` with the live estimate off;
- `+live`: the default live estimate (exact, from the backward pass's per-example gradient
  norms, where `cbs.stats.ghost` reads the model; else two-batch) and its EMA;
- `+live+exact/k`: also an exact B_simple measurement every k steps (which the exact live
  statistics give; else `Measurement`'s own jitted call), amortised over k steps.
Columns: median ms/step over repeats (after a warm-up run), tokens/s, MFU against the device
table in `cbs.runtime.throughput` ("unknown" on CPU), overhead against `plain` in the same
run, compile time of the step (lower + compile), and memory: the compiled step's temporaries
plus arguments (`memory_analysis`), and the device's peak bytes in use where it reports them.
A size whose parameters and Adam state do not fit the device is skipped. `--attention`
picks the model's attention kernel (`cbs.models.lm.ATTENTION`; the table's header says which
one ran), `--variants` which of the three rows run. `--profile=DIR` traces `--steps` plain steps
with `jax.profiler` after the timings (a Perfetto trace under DIR) and prints the operations
that took the most device time (`top_ops`). `--tied_forms` runs the `+live` and
`+live+exact/k` rows once per form of the tied embedding's norms (`cbs.stats.ghost_tied.FORM`:
"materialised", the path before `ghost_tied`, its per-example gradients by each use's
transpose in float32; "auto", the cheaper of "gram" and "direct", named with the form it
took; "gram"; "direct"), all in one run against one `plain` row.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import statistics
import time

import jax
import ml_collections
import numpy as np
from flax import nnx

from cbs import models
from cbs.engine import optim, step
from cbs.engine.measure import Measurement
from cbs.engine.noise_spec import NoiseSpec
from cbs.engine.state import init_train_state, stateless
from cbs.models import lm
from cbs.runtime import mesh as mesh_lib
from cbs.runtime import throughput
from cbs.stats import ghost, ghost_tied

VOCAB = 50304


def _setup(size: str, batch: int, seq_len: int, remat: str, dtype: str, model_axis: int,
           vocab: int, num_devices: int = 0, attention: str = "auto", unroll: int = 1):
    mc = models.default_model_config("lm")
    mc.update(size=size, remat=remat, compute_dtype=dtype, attention=attention,
              scan_unroll=unroll)
    model = nnx.eval_shape(lambda: models.build_model(
        mc, input_shape=(seq_len,), vocab_size=vocab, rngs=nnx.Rngs(0), verbose=False))
    graphdef, abstract, rest = models.split_model(model)
    mesh = mesh_lib.make_mesh(-1, model_axis, devices=jax.devices()[:num_devices or None])
    direction = optim.make_direction(ml_collections.ConfigDict(
        {"name": "adamw", "weight_decay": 0.1}))
    mode = "fsdp_tp" if mesh.size > 1 else "replicated"

    def init():
        _, params, _ = models.split_model(models.build_model(
            mc, input_shape=(seq_len,), vocab_size=vocab, rngs=nnx.Rngs(0), verbose=False))
        return init_train_state(params, direction, learning_rate=1e-4)

    shapes = jax.eval_shape(init)
    shard = lambda t: mesh_lib.param_shardings(t, mesh, mode)
    rep = lambda t: jax.tree.map(lambda _: mesh_lib.replicated(mesh), t)
    sharding = step.TrainState(rep(shapes.step), rep(shapes.examples_seen),
                               rep(shapes.learning_rate), shard(shapes.params),
                               shard(shapes.opt_state), rep(shapes.model_state),
                               rep(shapes.noise_ema), rep(shapes.measure_ema))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
    data = mesh_lib.shard({"x": tokens[:, :-1], "y": tokens[:, 1:]},
                          mesh_lib.batch_sharding(mesh))
    plain_loss = models.make_loss_fn(graphdef, rest, "lm")
    loss_fn = stateless(plain_loss)
    flops = lm.lm_flops_per_token(*_dims(mc), vocab, seq_len) * seq_len
    n_params = sum(x.size for x in jax.tree.leaves(abstract))
    return dict(init=init, sharding=sharding, mesh=mesh, data=data, loss_fn=loss_fn,
                plain_loss=plain_loss, abstract=abstract, direction=direction,
                flops_per_example=flops, n_params=n_params, description=model.description)


def _dims(mc) -> tuple[int, int, int]:
    s = lm.resolve_size(mc)
    return s.d_model, s.num_layers, s.d_ff


def _runner(s, *, batch: int, accum: int, two_batch: bool, every: int):
    replicas = mesh_lib.data_replicas(s["mesh"])
    measure = NoiseSpec(every=every) if every else None
    layout = step.BatchLayout(s["mesh"], s["sharding"], mesh_lib.batch_sharding(s["mesh"]),
                              micro_batch=batch // (accum * replicas))
    ts = step.TrainStep(s["loss_fn"], s["direction"], lambda lr, e, b: lr, layout,
                        step.StepOptions(live="auto" if two_batch else "none"))
    measurement = None if measure is None else Measurement(measure, ts, seed=0)
    state = jax.jit(s["init"], out_shardings=s["sharding"])()
    start = time.perf_counter()
    compiled = ts._jit.lower(state, s["data"], accum).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    program = None if mem is None else (mem.temp_size_in_bytes + mem.argument_size_in_bytes)
    t = 0

    def run(n):
        nonlocal state, t
        for _ in range(n):
            if measurement is None:
                state, metrics = ts(state, s["data"], accum)
            else:
                state, (metrics, _) = measurement.step(state, s["data"], accum, t)
            t += 1
        return metrics

    return run, compile_s, program, ts.live_kind(state, s["data"], accum)


def _time(run, steps: int) -> float:
    start = time.perf_counter()
    jax.block_until_ready(run(steps))
    return (time.perf_counter() - start) / steps


def _peak_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _fits(n_params: int) -> bool:
    """Parameters + Adam moments + gradients (4 float32 copies) under 60 % of the memory."""
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return limit is None or 16 * n_params < 0.6 * limit * jax.local_device_count()


def _tied_rule(s, micro_batch: int, seq_len: int) -> str:
    """How the embedding's norms are taken at the step's micro-batch (`ghost.leaf_rules`)."""
    tokens = jax.ShapeDtypeStruct((micro_batch, seq_len), np.int32)
    rules = ghost.leaf_rules(s["plain_loss"], s["abstract"], {"x": tokens, "y": tokens})
    return rules.get("embed", "untied")


def bench(size: str, args) -> list[dict]:
    s = _setup(size, args.batch, args.seq_len, args.remat, args.dtype, args.model_axis,
               args.vocab, args.devices, args.attention, args.unroll)
    if not _fits(s["n_params"]):
        print(f"{size}: {s['n_params'] / 1e6:.0f}M parameters do not fit; skipped")
        return []
    every = {"plain": dict(two_batch=False, every=0), "live": dict(two_batch=True, every=0),
             "exact": dict(two_batch=True, every=args.every)}
    names = {"plain": "plain", "live": "+live", "exact": f"+live+exact/{args.every}"}
    forms = args.tied_forms.split(",") if args.tied_forms else [None]
    micro = args.batch // (2 * mesh_lib.data_replicas(s["mesh"]))
    variants = {}
    for v in args.variants.split(","):
        for form in [None] if v == "plain" else forms:
            if form is None:
                variants[names[v]] = every[v], None
                continue
            ghost_tied.FORM = form
            try:
                rule = _tied_rule(s, micro, args.seq_len)
            finally:
                ghost_tied.FORM = "auto"
            label = f"{form} → {rule.split()[-1]}" if form == "auto" else form
            variants[f"{names[v]} [tied: {label}]"] = every[v], form
    print(f"{size}: {s['description']}", flush=True)
    runs = {}
    for name, (kw, form) in variants.items():
        ghost_tied.FORM = form or "auto"  # read when the step is traced (here and at warm-up)
        try:
            runs[name] = _runner(s, batch=args.batch, accum=2, **kw)
            jax.block_until_ready(runs[name][0](args.every))  # warm-up (covers one measurement)
        finally:
            ghost_tied.FORM = "auto"
    times = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved, so load on a shared machine hits all
        for k, (run, *_) in runs.items():
            times[k].append(_time(run, args.steps))
    if args.profile:
        first = next(iter(runs))
        trace_dir = pathlib.Path(args.profile) / f"{size}-{first}"
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            jax.block_until_ready(runs[first][0](args.steps))
        print(top_ops(trace_dir, steps=args.steps), flush=True)
    peak = throughput.peak_flops()
    devices = s["mesh"].size
    rows = []
    for k, (_, compile_s, program, live) in runs.items():
        sec = statistics.median(times[k])
        r = throughput.rates(args.batch, sec, 1, tokens_per_example=args.seq_len,
                             flops_per_example=s["flops_per_example"], peak=peak,
                             devices=devices)
        rows.append(dict(size=size, params=s["n_params"], variant=k, live=live, ms=sec * 1e3,
                         tokens_s=r["perf/tokens_per_s"], mfu=r.get("perf/mfu"),
                         compile_s=compile_s, program=program, peak=_peak_bytes()))
    return rows


def top_ops(trace_dir: pathlib.Path, steps: int, n: int = 15) -> str:
    """The `n` operations with the most device time per step in a Perfetto trace under
    `trace_dir` (events of the device's processes, grouped by name within each of its threads,
    so that the kernel and XLA-op views of one device are not added together)."""
    files = sorted(pathlib.Path(trace_dir).rglob("*.trace.json.gz"))
    if not files:
        return f"(no Perfetto trace under {trace_dir})"
    events = json.loads(gzip.open(files[-1]).read())["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M" and "args" in e]
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in meta
               if e.get("name") == "thread_name"}
    device = {e["pid"] for e in meta if e.get("name") == "process_name"
              and "/device:" in e["args"]["name"] and "host" not in e["args"]["name"].lower()}
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device:
            thread = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
            totals[thread][e["name"]] += float(e.get("dur", 0.0))
    lines = []
    for thread, counter in sorted(totals.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(counter.values())
        if total < 0.05 * max(sum(c.values()) for c in totals.values()):
            continue
        lines.append(f"\ndevice time per step on `{thread}`: {total / steps / 1e3:.2f} ms "
                     f"({len(counter)} distinct names)\n\n| op | ms/step | share |\n"
                     "|---|---:|---:|")
        for name, us in counter.most_common(n):
            lines.append(f"| {name[:90]} | {us / steps / 1e3:.3f} | {100 * us / total:.1f} % |")
    if not lines:
        procs = sorted({e["args"]["name"] for e in meta if e.get("name") == "process_name"})
        return f"(no device events in {files[-1]}; its processes: {procs})"
    return "\n".join(lines)


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke mode (tiny LM)")
    parser.add_argument("--sizes", default="", help="comma-separated rows of LM_SIZES")
    parser.add_argument("--batch", type=int, default=16, help="B sequences per step")
    parser.add_argument("--seq_len", type=int, default=1024, help="T tokens per sequence")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--remat", default="dots", choices=lm.REMAT_POLICIES)
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(lm.DTYPES))
    parser.add_argument("--model_axis", type=int, default=1, help="devices on the model axis")
    parser.add_argument("--devices", type=int, default=0,
                        help="use the first N devices (0 = all)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="steps between exact measurements")
    parser.add_argument("--attention", default="auto", choices=lm.ATTENTION,
                        help="the model's attention kernel")
    parser.add_argument("--unroll", type=int, default=1,
                        help="the model's scan unrolling over its layers")
    parser.add_argument("--variants", default="plain,live,exact",
                        help="rows to run: plain, live (the live estimate), exact (+ the "
                        "periodic exact measurement); the first is the overhead baseline")
    parser.add_argument("--profile", default="", help="trace the first variant into this "
                        "directory and print its top operations by device time")
    parser.add_argument("--tied_forms", default="",
                        help="comma-separated forms of the tied embedding's norms "
                        f"({', '.join(ghost_tied.FORMS)}): the live rows once per form")
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes = args.sizes or "tiny"
        args.batch = 4 * (args.devices or jax.device_count()) // args.model_axis  # m = 2, A = 2
        args.seq_len, args.vocab = 32, 80
        args.dtype = "float32"
        args.steps, args.repeats, args.every = min(args.steps, 4), min(args.repeats, 3), min(
            args.every, 4)
    sizes = args.sizes.split(",") if args.sizes else ["124m", "350m", "1b"]
    d = jax.devices()[0]
    peak = throughput.peak_flops()
    peak_s = "unknown" if peak is None else f"{peak / 1e12:.0f} TFLOP/s"
    used = args.devices or jax.device_count()
    print(f"device: {used} × {d.device_kind} ({d.platform}), peak {peak_s} per "
          f"device; B={args.batch} × T={args.seq_len}, A=2, remat={args.remat}, "
          f"compute {args.dtype}; median of "
          f"{args.repeats} × {args.steps} steps; jax {jax.__version__}, "
          f"{time.strftime('%Y-%m-%d')}\n")
    header = ("| size | params | variant | live | ms/step | tokens/s | MFU | overhead "
              "| compile s | step MiB | peak MiB |\n|---|---:|---|---|---:|---:|---:|---:|---:|"
              "---:|---:|")
    print(header)
    for size in sizes:
        rows = bench(size, args)
        base = rows[0]["ms"] if rows else 1.0
        for r in rows:
            mfu = "unknown" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %"
            print(f"| {r['size']} | {r['params'] / 1e6:.3g}M | {r['variant']} | {r['live']} | "
                  f"{r['ms']:.2f} | "
                  f"{r['tokens_s']:,.0f} | {mfu} | {100 * (r['ms'] / base - 1):+.1f} % | "
                  f"{r['compile_s']:.1f} | {_mib(r['program'])} | {_mib(r['peak'])} |",
                  flush=True)


if __name__ == "__main__":
    main()
