# The worker image: clusterfit with PyTorch, for the Kubernetes engine (and any cluster that runs containers).
#   CPU:  docker build -t clusterfit:cpu .
#   CUDA: docker build --build-arg VARIANT=cuda -t clusterfit:cuda .
# The CUDA variant takes PyTorch's default Linux wheels, which bring their own CUDA and cuDNN libraries: the
# host needs only the NVIDIA driver (and the NVIDIA container toolkit). The CPU variant takes PyTorch's CPU-only
# wheels, a few GB smaller.
FROM python:3.11-slim

ARG VARIANT=cpu
ARG EXTRAS=azure,s3
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/clusterfit
COPY pyproject.toml README.md ./
COPY src ./src
RUN set -eux; \
    case "$VARIANT" in \
      cpu) pip install --index-url https://download.pytorch.org/whl/cpu torch==2.14.1 torchvision==0.29.1 ;; \
      cuda) ;; \
      *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 2 ;; \
    esac; \
    pip install ".[$EXTRAS]"; \
    python -c "import clusterfit, torch; print('clusterfit', clusterfit.__version__, 'torch', torch.__version__)"

# Relative paths in a job spec (outputs.dir, code, data) resolve here, where the engine mounts its volumes.
WORKDIR /workspace
CMD ["clusterfit", "--help"]
