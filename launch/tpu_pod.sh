#!/usr/bin/env bash
# A Ray cluster on the hosts of a TPU pod slice, then the run on the head (host 0).
#
#   launch/tpu_pod.sh TPU_NAME ZONE gs://BUCKET/runs/gsm8k configs/gsm8k.py K [--config.x=y ...]
#
# Prerequisites: the repository checked out and installed with JAX's TPU plugin (`make install
# ACCEL=tpu`) at the same path on every host (e.g. `gcloud compute tpus tpu-vm ssh $TPU
# --zone=$ZONE --worker=all --command=...`),
# and a bucket every host can write (workdir and weights: the workers read each weights version
# from gs://.../weights). Host 0 runs the driver, i.e. the learner on its own chips: Ray gets no
# TPU resource there, so the K rollout workers (mesh.sampler_devices chips each) land on the other
# hosts. A learner spanning several hosts (runtime.learner_processes > 1) is started separately.
#
# NOT RUN HERE (no TPU and no gcloud on the development machine): untested.
set -euo pipefail
TPU=${1:?TPU name}
ZONE=${2:?zone}
WORKDIR=${3:?gs:// workdir}
CONFIG=${4:?config}
K=${5:?rollout workers}
shift 5
DIR=${REPO_DIR:-\$HOME/areal_jax}
PORT=${RAY_PORT:-6379}
ssh_to() {  # ssh_to WORKER COMMAND
  gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker="$1" --command="$2"
}
HEAD_IP=$(gcloud compute tpus tpu-vm describe "$TPU" --zone="$ZONE" \
  --format='value(networkEndpoints[0].ipAddress)')
ssh_to 0 "cd $DIR && .venv/bin/ray stop; .venv/bin/ray start --head --port=$PORT \
  --resources='{\"TPU\": 0}' --include-dashboard=false --disable-usage-stats"
ssh_to all "cd $DIR && if [ \"\$(hostname -I | cut -d' ' -f1)\" != $HEAD_IP ]; then \
  .venv/bin/ray stop; .venv/bin/ray start --address=$HEAD_IP:$PORT --disable-usage-stats; fi"
ssh_to 0 "cd $DIR && XLA_FLAGS= .venv/bin/python launch.py --config=$CONFIG --workdir=$WORKDIR \
  --config.runtime.mode=ray --config.runtime.ray_address=$HEAD_IP:$PORT \
  --config.runtime.worker_devices=tpu --config.rollout.workers=$K \
  --config.weights.transfer=orbax $*"
echo "run finished; stop the cluster with:"
echo "  gcloud compute tpus tpu-vm ssh $TPU --zone=$ZONE --worker=all --command='cd $DIR && .venv/bin/ray stop'"
