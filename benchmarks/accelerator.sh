#!/usr/bin/env bash
# The accelerator table of the benchmarks in one run that fits a few minutes of one GPU:
#
#     benchmarks/accelerator.sh OUT_DIR
#
# writes OUT_DIR/device.txt (the devices JAX sees), OUT_DIR/lm_step.md (`benchmarks.lm_step`
# at the 124m LM, B = 16, T = 1024, A = 2: tokens/s, MFU, the live estimate's and the
# periodic exact measurement's overhead, memory) and OUT_DIR/noise_cost_foreign.md
# (`benchmarks.noise_cost --foreign`: the exact statistics of models written without cbs
# layers against a plain gradient). Add the 350m LM when the device has the time:
# LM_ARGS="--sizes=124m,350m". LM_ARGS and NOISE_ARGS replace each script's arguments (a CPU
# smoke run: LM_ARGS="--tiny --repeats=1 --steps=2 --every=2 --devices=1"
# NOISE_ARGS="--models=mlp --skip-slow --repeats=1").
set -euo pipefail
out=${1:?usage: benchmarks/accelerator.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -c 'import jax; print(jax.__version__, jax.default_backend(), jax.devices())' \
  | tee "$out/device.txt"
# shellcheck disable=SC2086  # the arguments are meant to split
python3 -m benchmarks.lm_step ${LM_ARGS:---sizes=124m} | tee "$out/lm_step.md"
# shellcheck disable=SC2086
python3 -m benchmarks.noise_cost ${NOISE_ARGS:---foreign --repeats=5} \
  | tee "$out/noise_cost_foreign.md"
