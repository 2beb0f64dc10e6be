#!/usr/bin/env bash
# Multi-node launch with torchrun's c10d rendezvous (docs/distributed.md).
#
# Run the same command on every node; only NODE_RANK differs.
#   MASTER_ADDR   address of node 0 that every node can reach (hostname or IP)
#   MASTER_PORT   a free TCP port on node 0 (default 29500)
#   NNODES        number of nodes (default 2)
#   NODE_RANK     0 .. NNODES-1 (this node)
#   NPROC         processes per node: one per GPU, or CPU processes with gloo (default 1)
#   CONFIG        rootopt config (default configs/default.yaml)
#   RUN_DIR       run directory on a filesystem every node shares (checkpoints!)
#   HOSTFILE      optional: lines "ADDRESS slots=N" (hostfile.example); then NNODES is its
#                 number of nodes, MASTER_ADDR its first address and NPROC the slots of
#                 line NODE_RANK
# Extra arguments are passed to rootopt.train as config overrides (section.key=value).
#
# Example, two machines with 8 GPUs each:
#   node0$ MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=0 NPROC=8 RUN_DIR=/nfs/runs/a deploy/multinode/launch.sh
#   node1$ MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=1 NPROC=8 RUN_DIR=/nfs/runs/a deploy/multinode/launch.sh
set -euo pipefail

: "${NODE_RANK:?set NODE_RANK (0 on the node at MASTER_ADDR)}"
if [[ -n "${HOSTFILE:-}" ]]; then
  mapfile -t NODES < <(grep -Ev '^[[:space:]]*(#|$)' "${HOSTFILE}")
  NNODES="${#NODES[@]}"
  (( NODE_RANK < NNODES )) || { echo "launch.sh: NODE_RANK ${NODE_RANK} >= ${NNODES} nodes in ${HOSTFILE}" >&2; exit 2; }
  MASTER_ADDR="$(awk '{print $1}' <<< "${NODES[0]}")"
  NPROC="$(sed -n 's/.*slots=\([0-9]*\).*/\1/p' <<< "${NODES[${NODE_RANK}]}")"
  NPROC="${NPROC:-1}"
fi
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 (or HOSTFILE)}"
: "${RUN_DIR:?set RUN_DIR to a directory shared by all nodes}"
MASTER_PORT="${MASTER_PORT:-29500}"
NNODES="${NNODES:-2}"
NPROC="${NPROC:-1}"
CONFIG="${CONFIG:-configs/default.yaml}"

exec python -m torch.distributed.run \
  --nnodes="${NNODES}" \
  --nproc_per_node="${NPROC}" \
  --node_rank="${NODE_RANK}" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
  --rdzv-id="rootopt-$(basename "${RUN_DIR}")" \
  --max_restarts=3 \
  -m rootopt.train --config "${CONFIG}" --log_dir "${RUN_DIR}" "$@"
