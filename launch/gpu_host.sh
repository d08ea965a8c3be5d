#!/usr/bin/env bash
# One host with G GPUs: the learner on the first L, K rollout workers on the rest (Ray hands each
# worker mesh.sampler_devices GPUs through CUDA_VISIBLE_DEVICES).
#
#   launch/gpu_host.sh configs/gsm8k.py /data/runs/gsm8k L K [--config.x=y ...]
#   e.g. 8 GPUs: launch/gpu_host.sh configs/gsm8k.py /data/runs/gsm8k 4 2   (4 learner, 2 x 2 rollout)
#
# Prerequisites: the repository installed with JAX's CUDA plugin: `make install ACCEL=cuda12`
# (`ACCEL=cuda13` with a CUDA 13 driver). Without it JAX would run on the CPU; the script stops.
#
# NOT RUN HERE (no GPU on the development machine): the commands follow Ray's and JAX's documented
# behaviour but have not been exercised.
set -euo pipefail
CONFIG=${1:?config}
WORKDIR=${2:?workdir}
L=${3:?GPUs for the learner}
K=${4:?rollout workers}
shift 4
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
G=$(nvidia-smi --list-gpus | wc -l)
"$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null || {
  echo "error: JAX in $PY sees no GPU ($G attached): install its CUDA plugin, make install ACCEL=cuda12" >&2
  exit 1; }
RAY=$(dirname "$(command -v "$PY")")/ray  # the ray beside that Python, else the one on PATH
[ -x "$RAY" ] || RAY=ray
PER=$(( (G - L) / K ))
(( PER >= 1 )) || { echo "error: $G GPUs leave none for $K rollout workers after $L for the learner" >&2; exit 1; }
LEARNER_GPUS=$(seq -s, 0 $((L - 1)))
WORKER_GPUS=$(seq -s, "$L" $((G - 1)))
PORT=${RAY_PORT:-6390}
# Ray only sees (and hands out) the rollout GPUs; it is stopped when this script exits.
CUDA_VISIBLE_DEVICES=$WORKER_GPUS "$RAY" start --head --port="$PORT" --num-gpus=$((G - L)) \
  --include-dashboard=false --disable-usage-stats
trap '"$RAY" stop' EXIT
CUDA_VISIBLE_DEVICES=$LEARNER_GPUS XLA_FLAGS= "$PY" launch.py --config="$CONFIG" --workdir="$WORKDIR" \
  --config.runtime.mode=ray --config.runtime.ray_address=127.0.0.1:"$PORT" \
  --config.runtime.worker_devices=gpu --config.rollout.workers="$K" \
  --config.mesh.learner_devices="$L" --config.mesh.sampler_devices="$PER" \
  --config.weights.transfer=orbax "$@"
