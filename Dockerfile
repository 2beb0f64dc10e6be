# rootopt training image: torch pinned first, then rootopt with the `train` extra.
#
#   docker build -t rootopt:0.1.0-cpu .                             # CPU (gloo)
#   docker build --build-arg VARIANT=cuda -t rootopt:0.1.0-cuda .   # CUDA (nccl)
#
#   docker run --rm -v "$PWD/runs:/opt/rootopt/runs" rootopt:0.1.0-cpu          # rootopt train
#   docker run --rm rootopt:0.1.0-cpu train --config configs/deployment_example.yaml --print-config
#   docker run --rm --gpus all --entrypoint torchrun rootopt:0.1.0-cuda \
#       --standalone --nproc_per_node=2 -m rootopt.train
#
# deploy/kubeflow/pytorchjob.yaml runs rootopt:0.1.0-cuda (docs/deploy.md: pushing it to a
# registry your cluster pulls from). The tag's version is the package version in pyproject.toml.
#
# VARIANT selects the stage torch comes from; BuildKit (the default builder) builds only that
# stage. cpu: PyTorch's CPU wheel index. cuda: TORCH_CUDA_INDEX, by default PyPI, whose Linux
# torch wheel is built with CUDA and brings its CUDA libraries as pip packages (the host needs
# an NVIDIA driver and the NVIDIA container toolkit); a CUDA-specific index such as
# https://download.pytorch.org/whl/cu128 pins the CUDA version.
ARG VARIANT=cpu
ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0

FROM python:${PYTHON_VERSION}-slim AS base
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
WORKDIR /opt/rootopt

FROM base AS torch-cpu
ARG TORCH_VERSION
RUN python -m pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

FROM base AS torch-cuda
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX=https://pypi.org/simple
RUN python -m pip install --index-url "${TORCH_CUDA_INDEX}" "torch==${TORCH_VERSION}"

FROM torch-${VARIANT} AS final
# torch is already installed and satisfies rootopt's requirement, so pip keeps it.
COPY pyproject.toml README.md ./
COPY src ./src
COPY configs ./configs
RUN python -m pip install ".[train]" \
    && python -c "import torch, rootopt; print('rootopt', rootopt.__version__, 'torch', torch.__version__)"
# `rootopt train` writes its run directories under the working directory: mount runs/ (or pass
# --log_dir on a mounted volume) to keep them.
ENTRYPOINT ["rootopt"]
CMD ["train"]
