# One command runs the product (`make run`), one runs the tests (`make test`).
# Both create .venv and install what they need when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint bench install clean readme proto

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[gateway,test,bench]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/epp-local-gateway $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check epp_extproc kvindex trtllm_mock tests bench
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check epp_extproc kvindex trtllm_mock tests bench

readme: $(STAMP)
	$(BIN)/python -m epp_extproc.dev.readme_config

# Regenerate epp_extproc/proto_gen from proto/ (grpcio-tools, pinned in the test extras); a test checks the
# checked-in modules match.
proto: $(STAMP)
	$(BIN)/python proto/generate.py

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
