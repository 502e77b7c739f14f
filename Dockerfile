# rayfree node image.
#
# Offline (air-gapped clusters, and this repository's `make compose-check`): fill the wheelhouse on a
# machine whose pip can reach the packages, then build on any base image that has python3 and venv:
#   make wheelhouse                       # rayfree, its dependencies, numpy and *this host's* torch build
#   docker build --build-arg BASE_IMAGE=debian-bookworm-python:local -t rayfree:latest .
# The Python of the base must match the wheels' (the host's). A base made from OS packages, no registry:
#   debootstrap --variant=minbase --include=python3,python3-venv,iproute2,ca-certificates bookworm DIR
#   tar -C DIR -c . | docker import - debian-bookworm-python:local
# Online, with an empty wheelhouse: torch comes from TORCH_INDEX (CPU by default; for GPU nodes e.g.
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128), the rest from PyPI.
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    RAYFREE_LOG_LEVEL=INFO

WORKDIR /opt/rayfree
COPY pyproject.toml README.md ./
COPY transport transport
COPY cluster cluster
COPY worker worker
COPY executor executor
COPY rayfree rayfree
COPY docker/wheelhouse /tmp/wheelhouse
# numpy is installed beside torch so that torch does not warn "Failed to initialize NumPy" in every worker.
RUN python3 -m venv /opt/venv \
 && if ls /tmp/wheelhouse/rayfree-*.whl >/dev/null 2>&1; then \
        pip install --no-cache-dir --no-index --find-links /tmp/wheelhouse rayfree numpy "${TORCH_SPEC}"; \
    else \
        pip install --no-cache-dir --index-url "${TORCH_INDEX}" "${TORCH_SPEC}" \
        && pip install --no-cache-dir numpy .; \
    fi \
 && rm -rf /tmp/wheelhouse \
 && rayfree --help >/dev/null

# The engine's own package goes in a derived image (FROM rayfree:latest, pip install my-engine) and is named
# with RAYFREE_WORKER / RAYFREE_ENTRY.
ENTRYPOINT []
CMD ["rayfree", "node"]
