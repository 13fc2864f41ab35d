#!/usr/bin/env bash
# Pretraining on a Cloud TPU pod slice: the same command on every TPU VM of the slice.
#
#   launch/tpu_pod.sh TPU_NAME ZONE experiments/configs/k3_full.py /mnt/shared/runs/k3 \
#       --config.mesh.fsdp=64 --config.mesh.expert=16
#
# Arguments: TPU_NAME ZONE CONFIG WORKDIR [extra flags for launch.train]. The repository must be
# checked out and installed (`pip install -e .` plus jax[tpu]) at ~/k3 on every VM, and WORKDIR
# a directory every VM mounts (Filestore/NFS, or a bucket through gcsfuse). jax.distributed.initialize()
# finds the other hosts from the TPU metadata server, so no addresses are passed.
set -euo pipefail

TPU_NAME=${1:?usage: launch/tpu_pod.sh TPU_NAME ZONE CONFIG WORKDIR [flags]}
ZONE=${2:?usage: launch/tpu_pod.sh TPU_NAME ZONE CONFIG WORKDIR [flags]}
CONFIG=${3:?usage: launch/tpu_pod.sh TPU_NAME ZONE CONFIG WORKDIR [flags]}
WORKDIR=${4:?usage: launch/tpu_pod.sh TPU_NAME ZONE CONFIG WORKDIR [flags]}
shift 4
EXTRA=$(printf ' %q' "$@")

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  cd ~/k3 && \
  JAX_COMPILATION_CACHE_DIR=$WORKDIR/jax_cache \
  python -m launch.train --distributed --config=$CONFIG --workdir=$WORKDIR --config.mesh.data=-1 $EXTRA"
