#!/usr/bin/env bash
# Multi-node launch with torchrun's c10d rendezvous (docs/distributed.md).
#
# Run the same command on every node, from any working directory; only NODE_RANK differs.
#   MASTER_ADDR   address of node 0 that every node can reach (hostname or IP)
#   MASTER_PORT   a free TCP port on node 0 (default 29500)
#   NNODES        number of nodes (default 2)
#   NODE_RANK     0 .. NNODES-1 (this node)
#   NPROC         processes per node: one per GPU, or CPU processes with gloo (default 1)
#   CONFIG        rootopt config (default: configs/default.yaml of this repository; a relative
#                 path is relative to the current directory)
#   RUN_DIR       run directory on a filesystem every node shares (checkpoints!)
#   PYTHON        the interpreter that has rootopt installed (default: python on PATH)
#   DRY_RUN=1     print the torchrun command instead of running it
#   HOSTFILE      optional: lines "ADDRESS slots=N" (hostfile.example); then NNODES is its
#                 number of nodes, MASTER_ADDR its first address and NPROC the slots of
#                 line NODE_RANK
# Extra arguments are passed to rootopt.train as config overrides (section.key=value).
#
# Example, two machines with 8 GPUs each:
#   node0$ MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=0 NPROC=8 RUN_DIR=/nfs/runs/a ~/rootopt/deploy/multinode/launch.sh
#   node1$ MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=1 NPROC=8 RUN_DIR=/nfs/runs/a ~/rootopt/deploy/multinode/launch.sh
set -euo pipefail

# The repository this script belongs to (deploy/multinode/ -> ../..), whatever the cwd.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

fail() {  # a missing or wrong setting: one line, exit status 2 (a user error), nothing started
  echo "launch.sh: $*" >&2
  exit 2
}
[[ -n "${NODE_RANK:-}" ]] || fail "set NODE_RANK (0 on the node at MASTER_ADDR)"
[[ "${NODE_RANK}" =~ ^[0-9]+$ ]] || fail "NODE_RANK must be a number, not '${NODE_RANK}'"
if [[ -n "${HOSTFILE:-}" ]]; then
  [[ -f "${HOSTFILE}" ]] || fail "HOSTFILE ${HOSTFILE} is not a file"
  mapfile -t NODES < <(grep -Ev '^[[:space:]]*(#|$)' "${HOSTFILE}")
  NNODES="${#NODES[@]}"
  (( NODE_RANK < NNODES )) || fail "NODE_RANK ${NODE_RANK} >= ${NNODES} nodes in ${HOSTFILE}"
  MASTER_ADDR="$(awk '{print $1}' <<< "${NODES[0]}")"
  NPROC="$(sed -n 's/.*slots=\([0-9]*\).*/\1/p' <<< "${NODES[${NODE_RANK}]}")"
  NPROC="${NPROC:-1}"
fi
[[ -n "${MASTER_ADDR:-}" ]] || fail "set MASTER_ADDR to the address of node 0 (or HOSTFILE)"
[[ -n "${RUN_DIR:-}" ]] || fail "set RUN_DIR to a directory shared by all nodes"
MASTER_PORT="${MASTER_PORT:-29500}"
NNODES="${NNODES:-2}"
NPROC="${NPROC:-1}"
CONFIG="${CONFIG:-${REPO}/configs/default.yaml}"
[[ -f "${CONFIG}" ]] || fail "CONFIG ${CONFIG} is not a file"

cmd=(
  "${PYTHON:-python}" -m torch.distributed.run
  --nnodes="${NNODES}"
  --nproc_per_node="${NPROC}"
  --node_rank="${NODE_RANK}"
  --rdzv-backend=c10d
  --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}"
  --rdzv-id="rootopt-$(basename "${RUN_DIR}")"
  --max_restarts=3
  -m rootopt.train --config "${CONFIG}" --log_dir "${RUN_DIR}" "$@"
)
if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
