# rayfree node image. CPU build of torch by default; for GPU nodes pick the CUDA wheel index, e.g.
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t rayfree:latest .
FROM python:3.12-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

RUN apt-get update \
 && apt-get install -y --no-install-recommends iproute2 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/rayfree
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY transport transport
COPY cluster cluster
COPY worker worker
COPY executor executor
COPY rayfree rayfree
RUN pip install --no-cache-dir .

# The engine's own package goes in a derived image (FROM rayfree:latest, pip install my-engine) and is named
# with RAYFREE_WORKER / RAYFREE_ENTRY.
ENV RAYFREE_LOG_LEVEL=INFO
ENTRYPOINT []
CMD ["rayfree", "node"]
