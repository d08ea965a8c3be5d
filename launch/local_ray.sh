#!/usr/bin/env bash
# A run with rollout workers in their own processes on THIS machine (runtime.mode=ray).
#
#   launch/local_ray.sh configs/gsm8k.py:tiny /tmp/gsm8k_ray [K] [--config.x=y ...]
#
# launch.py starts a local Ray cluster by itself (no dashboard, a temporary directory) and stops it
# when the run ends. On CPU the learner (this process) and each of the K rollout workers get cores of
# their own (runtime.learner_cores; a worker owns mesh.sampler_devices fake devices). Weights go
# through Orbax under <workdir>/weights.
set -euo pipefail
CONFIG=${1:?config, e.g. configs/gsm8k.py:tiny}
WORKDIR=${2:?workdir}
WORKERS=${3:-1}
shift $(( $# < 3 ? $# : 3 ))
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" launch.py --config="$CONFIG" --workdir="$WORKDIR" \
  --config.runtime.mode=ray --config.rollout.workers="$WORKERS" --config.weights.transfer=orbax "$@"
