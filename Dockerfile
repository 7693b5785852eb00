# The worker images: clusterfit with PyTorch (and, for TensorFlow jobs, TensorFlow too), for the Kubernetes
# engine and any cluster that runs containers. Both have Open MPI's mpirun and mpi4py (the mpi extra).
#   PyTorch, CPU:      docker build -t clusterfit:cpu .
#   PyTorch, CUDA:     docker build --build-arg VARIANT=cuda -t clusterfit:cuda .
#   TensorFlow, CPU:   docker build --build-arg FRAMEWORK=tensorflow -t clusterfit:tf-cpu .
#   TensorFlow, CUDA:  docker build --build-arg FRAMEWORK=tensorflow --build-arg VARIANT=cuda -t clusterfit:tf-cuda .
# The CUDA variant takes PyTorch's default Linux wheels (and tensorflow[and-cuda]), which bring their own CUDA
# and cuDNN libraries: the host needs only the NVIDIA driver (and the NVIDIA container toolkit). The CPU variant
# takes PyTorch's CPU-only wheels and tensorflow-cpu, a few GB smaller. The TensorFlow image keeps PyTorch:
# clusterfit's launcher is torchrun's agent whatever the job's framework.
FROM python:3.11-slim

ARG VARIANT=cpu
ARG FRAMEWORK=pytorch
ARG EXTRAS=azure,s3,mpi
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
    case "$FRAMEWORK/$VARIANT" in \
      pytorch/*) ;; \
      tensorflow/cpu) pip install "tensorflow-cpu>=2.16" ;; \
      tensorflow/cuda) pip install "tensorflow[and-cuda]>=2.16" ;; \
      *) echo "FRAMEWORK must be pytorch or tensorflow, not $FRAMEWORK" >&2; exit 2 ;; \
    esac; \
    pip install ".[$EXTRAS]"; \
    python -c "import clusterfit, torch; print('clusterfit', clusterfit.__version__, 'torch', torch.__version__)"; \
    mpirun --version | head -1; \
    if [ "$FRAMEWORK" = tensorflow ]; then python -c "import tensorflow as tf; print('tensorflow', tf.__version__)"; fi

# Relative paths in a job spec (outputs.dir, code, data) resolve here, where the engine mounts its volumes.
# Jobs run unprivileged: uid 1000 is also the Kubernetes pods' default runAsUser (resources.kubernetes.run_as_user).
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin clusterfit && mkdir -p /workspace && chown clusterfit /workspace
WORKDIR /workspace
USER 1000
CMD ["clusterfit", "--help"]
