"""cbs.runtime.throughput: rates and MFU by hand, the device table, the record meter, the
profiler window and the compilation-cache setting."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import time

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from cbs import models
from cbs.engine import config as config_lib
from cbs.runtime import throughput
from cbs.runtime.fields import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent


class _Device:
    def __init__(self, platform, kind):
        self.platform, self.device_kind = platform, kind


def test_peak_table_and_unknown_on_cpu():
    assert throughput.peak_flops() is None  # the test devices are CPUs
    assert throughput.peak_flops(_Device("gpu", "NVIDIA H100 80GB HBM3")) == 989e12
    assert throughput.peak_flops(_Device("gpu", "NVIDIA H100 PCIe")) == 756e12
    assert throughput.peak_flops(_Device("gpu", "NVIDIA A100-SXM4-80GB")) == 312e12
    assert throughput.peak_flops(_Device("tpu", "TPU v5 lite")) == 197e12
    assert throughput.peak_flops(_Device("tpu", "TPU v4")) == 275e12
    assert throughput.peak_flops(_Device("gpu", "Some Future GPU")) is None


def test_rates_and_mfu_by_hand():
    r = throughput.rates(1000, 2.0, 10, tokens_per_example=64, flops_per_example=3e9,
                         peak=1e12, devices=4)
    assert r["perf/step_time_s"] == pytest.approx(0.2)
    assert r["perf/examples_per_s"] == pytest.approx(500.0)
    assert r["perf/tokens_per_s"] == pytest.approx(32_000.0)
    assert r["perf/mfu"] == pytest.approx(3e9 * 500 / 4e12)
    assert "perf/mfu" not in throughput.rates(1000, 2.0, 10, flops_per_example=3e9, peak=None)


def test_meter_times_windows_between_reads():
    meter = throughput.Meter(tokens_per_example=8, flops_per_example=100.0, peak=1e6)
    first = [{"kind": "train", "step": s, "data/examples_seen": 4 * s, "data/batch_size": 4}
             for s in range(3)]
    meter.annotate(first)  # the compilation window is not timed
    assert "perf/step_time_s" not in first[0] and first[2]["data/tokens_seen"] == 64
    time.sleep(0.05)
    second = [{"kind": "train", "step": s, "data/examples_seen": 4 * s, "data/batch_size": 4}
              for s in range(3, 5)] + [{"kind": "eval", "step": 5}]
    meter.annotate(second)
    r = second[-2]
    assert 0.025 <= r["perf/step_time_s"] < 1.0  # 2 steps in >= 50 ms
    assert r["perf/examples_per_s"] == pytest.approx(8 / (2 * r["perf/step_time_s"]))
    assert r["perf/tokens_per_s"] == pytest.approx(8 * r["perf/examples_per_s"])
    assert r["perf/mfu"] == pytest.approx(100.0 * r["perf/examples_per_s"] / 1e6)
    assert "perf/step_time_s" not in second[-1]


def test_lm_flops_per_example_from_config():
    c = config_lib.default_config()
    c.model = models.default_model_config("lm")
    per = throughput.model_flops_per_example(c, (16,), 80)
    assert per == pytest.approx(16 * models.lm.lm_flops_per_token(32, 2, 64, 80, 16))
    c.model = models.default_model_config("mlp")
    assert throughput.model_flops_per_example(c, (64,), None) is None


def test_profile_window_and_compilation_cache(tmp_path):
    window = throughput.ProfileWindow(1, 2, str(tmp_path / "profile"))
    f = jax.jit(lambda x: x * 2)
    for step in range(4):
        window.at_step(step)
        f(jax.numpy.ones(3)).block_until_ready()
    window.close()
    assert any(files for _, _, files in os.walk(tmp_path / "profile"))
    previous = jax.config.jax_compilation_cache_dir
    try:
        throughput.enable_compilation_cache(str(tmp_path / "cache"))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


def test_perf_config_is_validated():
    c = config_lib.default_config()
    c.perf.profile_start = -2
    with pytest.raises(ConfigError, match="perf.profile_start"):
        config_lib.validate(c, data_replicas=1)


@pytest.fixture
def no_compilation_cache():
    """Off for one test: the session's persistent cache (tests/conftest.py) hands the
    benchmark a deserialized copy of the step it compiled ahead of time, and on the 8 fake CPU
    devices that copy, run between exact measurements, hangs in a collective rendezvous."""
    previous = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", previous)
        compilation_cache.reset_cache()


def test_lm_step_benchmark_tiny_mode(capsys, no_compilation_cache):
    """benchmarks/lm_step.py --tiny: the table has every variant, MFU "unknown" on CPU."""
    from benchmarks import lm_step

    # One device: the table is what is checked here (the sharded LM step is test_lm's; on
    # the 8 fake devices each of the three variants compiled for about 10 s).
    lm_step.main(["--tiny", "--repeats=1", "--steps=2", "--every=2", "--devices=1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny")]
    assert [r.split("|")[3].strip() for r in rows] == ["plain", "+live", "+live+exact/2"]
    assert [r.split("|")[4].strip() for r in rows] == ["none", "exact", "exact"]  # live kind
    assert all(r.split("|")[7].strip() == "unknown" for r in rows)
    assert all(float(r.split("|")[6].replace(",", "")) > 0 for r in rows)
    assert "attention=xla" in out and f"jax {jax.__version__}" in out


def test_lm_step_benchmark_compares_the_tied_embedding_forms(capsys, no_compilation_cache):
    """--tied_forms: one live row per form of the tied embedding's norms, "auto" named with
    the form it took, against one plain row; the form is put back after each."""
    from benchmarks import lm_step
    from cbs.stats import ghost_tied

    lm_step.main(["--tiny", "--repeats=1", "--steps=2", "--devices=1", "--variants=plain,live",
                  "--tied_forms=materialised,auto,gram"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert [r.split("|")[3].strip() for r in rows] == [
        "plain", "+live [tied: materialised]", "+live [tied: auto → direct]",
        "+live [tied: gram]"]
    assert [r.split("|")[4].strip() for r in rows] == ["none", "exact", "exact", "exact"]
    assert ghost_tied.FORM == "auto"


def test_full_data_cost_benchmark_quick(capsys):
    """benchmarks/full_data_cost.py --quick (digits): every row, an evaluation under the
    protocol costing 2 × (norms + 257 HVPs) for Adam, in units of one gradient."""
    from benchmarks import full_data_cost

    full_data_cost.main(["--quick"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [float(x.replace(",", "")) for x in
                                         line.split("|")[2:4]]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line
            and "seconds" not in line}
    assert list(rows)[:3] == ["gradient", "per-example norms", "HVP"]
    assert rows["gradient"][1] == 1.0
    evaluation = next(v for k, v in rows.items() if k.startswith("one evaluation: 256"))
    expected = 2 * (rows["per-example norms"][0] + 257 * rows["HVP"][0])
    assert evaluation[0] == pytest.approx(expected, rel=0.05)  # shown to 3 digits


def test_sampled_precision_benchmark_quick(capsys):
    """benchmarks/sampled_precision.py --quick (digits): a row per statistic, the Hessian
    draw's part only for the curvature ones, positive standard errors."""
    from benchmarks import sampled_precision

    sampled_precision.main(["--quick"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line
            and "statistic" not in line}
    assert list(rows) == list(sampled_precision.KEYS)
    assert all(float(v[1].rstrip("%")) > 0 for v in rows.values())
    assert rows["b_simple"][2] == "–" and rows["b_noise"][2].endswith("%")
    assert "n = 256, m = 16, h = 64" in out


def test_train_step_benchmark_pairs_every_variant_with_its_baseline(no_compilation_cache):
    """benchmarks/train_step.py: one ABBA repeat on the MLP gives a positive ratio for every
    (variant, baseline) pair, the exact live estimate where the ghost rules read the model,
    and runs whose length is a multiple of the measurement period."""
    from benchmarks import train_step

    times, ratios, kinds, n = train_step.bench("mlp", steps=3, repeats=1, every=2,
                                                min_seconds=0.0)
    pairs = [(v, b) for v, b, _ in train_step._pairs(2)]
    assert list(ratios) == pairs
    assert all(len(r) == 1 and r[0] > 0 for r in ratios.values())
    assert n == 4  # 3 steps rounded up to the period
    assert kinds["cbs + live"] == "exact" and kinds["cbs + two-batch (halves)"] == "two_batch"
    # each pair's four runs are recorded: two per pair a variant is in, on either side
    assert len(times["cbs + live"]) == 2 * 2  # variant vs no estimate, baseline of exact/2
    assert len(times["cbs (no estimate)"]) == 2 * 4  # vs both optax loops; live, two-batch


def test_train_step_verdict_says_where_the_repeats_straddle_the_target():
    from benchmarks.train_step import verdict

    assert verdict("≤ 1.05×", [0.98, 1.01, 1.04]) == "met"
    assert verdict("≤ 1.05×", [1.06, 1.2]) == "not met"
    assert verdict("≤ 1.05×", [1.0, 1.04, 1.08]) == "median met; repeats straddle it (noise)"
    assert verdict("≥ 0.97× speed", [0.9, 0.95, 0.98]) == (
        "median not met; repeats straddle it (noise)")
    assert verdict("≥ 0.97× speed", [0.97, 1.1]) == "met" and verdict("", [1.0]) == ""


def test_accelerator_script_goes_on_past_a_failed_part(tmp_path):
    """A part that fails leaves its error and status, and the parts after it still write
    their tables; the script's own status says a part failed."""
    env = dict(os.environ, PARTS="lm_step device", LM_ARGS="--no-such-flag",
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "accelerator.sh"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    status = (tmp_path / "status.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in status] == ["lm_step", "device"]
    assert "exit 2" in status[0] and "exit 0" in status[1]
    assert "--no-such-flag" in (tmp_path / "lm_step.err").read_text()
    assert f"jax {jax.__version__}" in (tmp_path / "device.md").read_text()


@pytest.mark.slow
def test_accelerator_script_writes_its_tables_in_cpu_smoke_mode(tmp_path):
    """benchmarks/accelerator.sh with the smoke arguments its header names (about a minute on
    2 CPU cores): the device line and both tables."""
    env = dict(os.environ, LM_ARGS="--tiny --repeats=1 --steps=2 --every=2 --devices=1",
               NOISE_ARGS="--models=mlp --skip-slow --repeats=1", JAX_PLATFORMS="cpu",
               PARTS="device lm_step noise_cost")
    env.pop("XLA_FLAGS", None)  # one CPU device, as on a machine with one accelerator
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "accelerator.sh"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu" in (tmp_path / "device.md").read_text()
    lm = (tmp_path / "lm_step.md").read_text()
    assert [line.split("|")[3].strip() for line in lm.splitlines()
            if line.startswith("| tiny")] == ["plain", "+live", "+live+exact/2"]
    assert "| exact-fast |" in (tmp_path / "noise_cost_foreign.md").read_text()


def test_top_ops_reads_a_committed_gpu_trace(tmp_path):
    """`lm_step.top_ops` on the H200 trace committed with the benchmarks guide: the device's
    stream, cuDNN's attention among the top kernels, shares adding up under 100 %."""
    from benchmarks import lm_step

    trace = ROOT / "benchmarks" / "device" / "h200-2026-12-04" / "run2_plain.trace.json.gz"
    (tmp_path / "run").mkdir()
    shutil.copy(trace, tmp_path / "run" / "gpu.trace.json.gz")
    table = lm_step.top_ops(tmp_path, steps=5, n=10)
    assert "device time per step on `Stream" in table and "42.72 ms" in table
    assert "cudnn_generated" in table and "f32f32_tf32" not in table  # no float32 matmul
    shares = [float(line.split("|")[3].strip(" %")) for line in table.splitlines()
              if line.startswith("| ") and line.endswith("% |")]
    assert len(shares) == 10 and 0 < sum(shares) < 100
