#!/usr/bin/env bash
# Install rootopt into ./.venv and run it, from a fresh clone with only python3 (>= 3.10).
#
#   scripts/dev.sh run  [ARGS...]   install with the `train` extra, then: rootopt train ARGS
#   scripts/dev.sh test [ARGS...]   install with every extra, then: pytest -q ARGS
#   scripts/dev.sh install [EXTRAS] install only (default extras: train)
#
# The extra name `analysis` stands for the rootopt-analysis package of ./analysis (benchmarks,
# the defaults study, coefficient fitting, the cost model; not in the rootopt wheel): `test`
# installs it, editable, beside rootopt; `install train,analysis` does too.
#
# torch is installed first, pinned to TORCH_VERSION, before anything else is resolved: a
# package that merely requires "torch" would otherwise let pip pick the newest torch, whose
# Linux wheel on PyPI is a CUDA build of several GB. TORCH_INDEX_URL (default: PyTorch's CPU
# wheel index) is offered to pip as an extra index for the torch wheel alone (its dependencies
# come from the default index), so the CPU build is preferred where it exists. Set
# TORCH_INDEX_URL= (empty) to take PyPI's default build, or a CUDA index such as
# https://download.pytorch.org/whl/cu128 on a GPU machine.
#
# Rerunning is cheap: the install is skipped while pyproject.toml and the extras are unchanged
# (a stamp in .venv records them). Rerunning `scripts/dev.sh run` after Ctrl-C resumes the run.
set -euo pipefail

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
ALL_EXTRAS="train,bench,dev,integrations,rl,anneal,analysis"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-${repo}/.venv}"

usage() {
  sed -n '2,7s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2
}

install() {  # install EXTRAS
  local extras="$1"
  if [[ ! -x "${venv}/bin/python" ]]; then
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
      || { echo "dev.sh: rootopt needs Python >= 3.10; python3 is $(python3 -V 2>&1)" >&2; exit 2; }
    python3 -m venv "${venv}"
  fi
  # The stamp records what is installed: "torch==V <pyproject checksum>" and the extras.
  local stamp="${venv}/.rootopt-install"
  local key
  key="torch==${TORCH_VERSION} $(cat "${repo}/pyproject.toml" "${repo}/analysis/pyproject.toml" | cksum)"
  if [[ -f "${stamp}" && "$(head -n 1 "${stamp}")" == "${key}" ]]; then
    local have missing=""
    have=",$(sed -n 2p "${stamp}"),"
    for e in ${extras//,/ }; do
      [[ "${have}" == *",${e},"* ]] || missing=1
    done
    [[ -z "${missing}" ]] && return 0
  fi
  local pip=("${venv}/bin/python" -m pip install --quiet)
  local index=()
  [[ -n "${TORCH_INDEX_URL}" ]] && index=(--extra-index-url "${TORCH_INDEX_URL}")
  # `analysis` is a package of its own, installed in the same pip call as rootopt (whose
  # version it pins), never an extra of rootopt
  local rootopt_extras analysis=() also=""
  rootopt_extras="$(tr ',' '\n' <<< "${extras}" | { grep -vx analysis || true; } | paste -sd, -)"
  [[ ",${extras}," == *",analysis,"* ]] && analysis=(-e "${repo}/analysis") && also=" and rootopt-analysis"
  echo "dev.sh: installing torch==${TORCH_VERSION}, then rootopt[${rootopt_extras}]${also} into ${venv}" >&2
  # torch alone from the torch index, then its dependencies from the default index only
  "${pip[@]}" --no-deps ${index[@]+"${index[@]}"} "torch==${TORCH_VERSION}"
  "${pip[@]}" "torch==${TORCH_VERSION}"
  "${pip[@]}" -e "${repo}${rootopt_extras:+[${rootopt_extras}]}" ${analysis[@]+"${analysis[@]}"}
  printf '%s\n%s\n' "${key}" "${extras}" > "${stamp}"
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "${cmd}" in
  run)
    install train
    exec "${venv}/bin/rootopt" train "$@"
    ;;
  test)
    install "${ALL_EXTRAS}"
    cd "${repo}"
    exec "${venv}/bin/python" -m pytest -q "$@"
    ;;
  install)
    install "${1:-train}"
    ;;
  *)
    usage
    exit 2
    ;;
esac
