#!/bin/bash
# FP8 training on several nodes with torchrun (no scheduler): run this script once on every node.
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 examples/multinode/torchrun_fp8_train.sh precision=fp8_mxfp8
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 examples/multinode/torchrun_fp8_train.sh precision=fp8_mxfp8
# One machine, CPU only (2 processes, gloo), to try the recipe anywhere:
#   NNODES=1 NPROC_PER_NODE=2 ACCELERATOR=cpu examples/multinode/torchrun_fp8_train.sh experiment=smoke
# Lightning detects the torchrun environment (TorchElasticEnvironment) and does not spawn processes itself.
set -euo pipefail
NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
ACCELERATOR=${ACCELERATOR:-gpu}
# every rank must write into the same run folder: a fixed name, not the clock of each process
RUN_DIR=${RUN_DIR:-outputs/torchrun/$(date +%Y-%m-%d)}
PYTHON=${PYTHON:-python}

exec "${PYTHON}" -m torch.distributed.run \
    --nnodes="${NNODES}" --node-rank="${NODE_RANK}" --nproc-per-node="${NPROC_PER_NODE}" \
    --master-addr="${MASTER_ADDR}" --master-port="${MASTER_PORT}" \
    -m fp8_lightning.train \
    trainer=ddp \
    trainer.accelerator="${ACCELERATOR}" \
    trainer.num_nodes="${NNODES}" \
    trainer.devices="${NPROC_PER_NODE}" \
    hydra.run.dir="${RUN_DIR}" \
    "$@"
