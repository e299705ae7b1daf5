#!/usr/bin/env bash
# The accelerator check of the benchmarks as one job of a few minutes on one GPU:
#
#     benchmarks/accelerator.sh OUT_DIR
#
# Each part runs on its own, in this order, and writes its table whatever the others did; a
# part that fails leaves its error in OUT_DIR/PART.err and its exit status in
# OUT_DIR/status.txt, and the script goes on (it exits non-zero at the end if any part failed):
#
#   device      OUT_DIR/device.md: JAX, jaxlib, flax and optax versions, the devices, the date
#   install     cbs from this source tree into the machine's Python (--no-deps): only what
#               the image lacks comes from the wheels in $WHEELS (default .whl/: ml_collections
#               on an image with JAX, flax, optax and orbax)
#   tests       OUT_DIR/tests.md: the JAX-walking tests (ghost norms, coupling, drop-in, the
#               LM, the nested primitives) on this machine's JAX release, on its CPU, and the
#               GPU-only checks (tests/test_gpu.py: cuDNN attention, ghost norms through it)
#   settings    OUT_DIR/settings.md: the plain 124m step under other settings than the default
#               (XLA's attention, the layers' scan unrolled, Triton's GEMM fusions off)
#   lm_step     OUT_DIR/lm_step.md: `benchmarks.lm_step` at 124m and 350m, B = 16, T = 1024, A = 2
#               (tokens/s, MFU, the live estimate's and the periodic exact measurement's
#               overhead, memory)
#   tied        OUT_DIR/tied.md: the 124m step's live estimate with the tied embedding's norms
#               each way (`lm_step --tied_forms`: the materialised path before
#               `cbs.stats.ghost_tied`, the form it picks, its Gram and its direct form)
#   profile     OUT_DIR/profile.md: top operations of the 124m step by device time, plain and
#               with the live estimate, and their Perfetto traces under OUT_DIR/trace/
#   noise_cost  OUT_DIR/noise_cost_foreign.md: `benchmarks.noise_cost --foreign` (the exact
#               statistics of models written without cbs layers against a plain gradient)
#
# PARTS (default: all, in the order above) picks parts; LM_ARGS, TIED_ARGS, NOISE_ARGS and
# TEST_ARGS replace each part's arguments. A CPU smoke run (about a minute on 2 cores):
#   PARTS="device lm_step noise_cost" LM_ARGS="--tiny --repeats=1 --steps=2 --every=2 \
#   --devices=1" NOISE_ARGS="--models=mlp --skip-slow --repeats=1" benchmarks/accelerator.sh /tmp/acc
out=${1:?usage: benchmarks/accelerator.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
parts=${PARTS:-device install tests settings lm_step tied profile noise_cost}
failed=0

run_part() {  # run_part NAME COMMAND...: stdout to NAME.md, stderr to NAME.err, status noted
  local name=$1
  shift
  echo "== $name: $*"
  local start=$SECONDS
  "$@" >"$out/$name.md" 2>"$out/$name.err"
  local status=$?
  echo "$name: exit $status in $((SECONDS - start)) s" | tee -a "$out/status.txt"
  tail -n 40 "$out/$name.md"
  if [ "$status" -ne 0 ]; then
    failed=1
    tail -n 20 "$out/$name.err"
  fi
}

device_info() {
  date -u '+%Y-%m-%d %H:%M UTC'
  "$python" - <<'EOF'
import importlib.metadata as md
import jax
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} missing")
print(jax.default_backend(), jax.devices())
EOF
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader
  return 0
}

install_cbs() {
  local wheels=${WHEELS:-.whl}
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/cbs-site \
      "$wheels"/*.whl || return
    export PYTHONPATH=/tmp/cbs-site${PYTHONPATH:+:$PYTHONPATH}
  fi
  if ! "$python" -m pip install -q --no-deps --no-build-isolation -e .; then
    echo "pip could not install the source tree (its setuptools?): cbs runs from it instead"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
  "$python" -c 'import cbs, ml_collections; print("cbs", cbs.__version__, "from", cbs.__file__)'
}

gpu_tests() {
  # The walkers on this JAX release, on the CPU (8 fake devices, as in CI); then the checks
  # that need the GPU itself.
  # shellcheck disable=SC2086  # the arguments are meant to split
  JAX_PLATFORMS=cpu "$python" -m pytest -q -p no:cacheprovider -o addopts="" -n 8 \
    ${TEST_ARGS:-tests/test_nested.py tests/test_ghost.py tests/test_ghost_stats.py \
    tests/test_ghost_tied.py tests/test_dropin.py tests/test_lm.py tests/test_live_noise.py} \
    2>&1 | tail -n 30
  local cpu=${PIPESTATUS[0]}
  XLA_FLAGS= JAX_PLATFORMS= "$python" -m pytest -q -p no:cacheprovider -o addopts="" -rs \
    tests/test_gpu.py 2>&1 | tail -n 30
  local gpu=${PIPESTATUS[0]}
  return $((cpu || gpu))
}

settings_table() {  # one process per setting: the plain step's row
  local plain=(--sizes=124m --variants=plain --repeats=3)
  "$python" -m benchmarks.lm_step "${plain[@]}" --attention=xla || return
  "$python" -m benchmarks.lm_step "${plain[@]}" --unroll=12 || return
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" \
    "$python" -m benchmarks.lm_step "${plain[@]}" || return
}

profiles() {
  for variant in plain live; do
    "$python" -m benchmarks.lm_step --sizes=124m --variants=$variant --repeats=1 --steps=5 \
      --profile="$out/trace" || return
  done
}

for part in $parts; do
  case $part in
    device) run_part device device_info ;;
    install) run_part install install_cbs ;;
    tests) run_part tests gpu_tests ;;
    settings) run_part settings settings_table ;;
    # shellcheck disable=SC2086
    lm_step) run_part lm_step "$python" -m benchmarks.lm_step ${LM_ARGS:---sizes=124m,350m} ;;
    # shellcheck disable=SC2086
    tied) run_part tied "$python" -m benchmarks.lm_step ${TIED_ARGS:---sizes=124m \
      --variants=plain,live --tied_forms=materialised,auto,gram,direct} ;;
    profile) run_part profile profiles ;;
    # shellcheck disable=SC2086
    noise_cost) run_part noise_cost_foreign "$python" -m benchmarks.noise_cost \
      ${NOISE_ARGS:---foreign --repeats=5} ;;
    *) echo "unknown part $part (device install tests settings lm_step tied profile" \
         "noise_cost)"
       failed=1 ;;
  esac
done
exit $failed
