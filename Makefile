# Two commands on a fresh machine: `make serve` (server on the shipped model) and `make test`.
# Each installs what it needs into the project venv first (torch pinned to the local CPU wheel).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install native serve test int4-model draft-exit gate clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The native decode executor, compiled for this CPU and cached (~/.cache/tinyloop/kernels; a few seconds the
# first time, nothing after). Without a C++ compiler it says so and the PyTorch path serves.
native: $(STAMP)
	$(VENV)/bin/python -m tinyloop.kernels.build

serve: native
	$(VENV)/bin/tinyloop serve $(ARGS)

# The suite is split over two worker processes (pytest-xdist), a test file per worker at a time.
TEST_WORKERS ?= 2
test: native
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Rebuild the packaged int4 model from the packaged fp16 one (GPTQ, calibrated on the training split of
# the corpus; docs/quantization.md). CORPUS defaults to the shared copy; scripts/build_corpus.py rebuilds it.
CORPUS ?= ../shared/corpus
MODELS := src/tinyloop/assets/models
int4-model: $(STAMP)
	$(VENV)/bin/tinyloop quantize $(MODELS)/tinyloop-16m.tinyloop $(MODELS)/tinyloop-16m-int4.tinyloop \
	    --bits 4 --group-size 32 --method gptq --calib-tokens 8192 --calib-val-fraction 0.01 \
	    --calib $(CORPUS)/brown.txt.gz $(CORPUS)/kjv.txt.gz $(CORPUS)/pydocs.txt.gz $(CORPUS)/shakespeare.txt.gz

draft-exit: $(STAMP)
	$(VENV)/bin/tinyloop train-draft $(MODELS)/tinyloop-16m.tinyloop --threads 2 \
	    $(CORPUS)/brown.txt.gz $(CORPUS)/kjv.txt.gz $(CORPUS)/pydocs.txt.gz $(CORPUS)/shakespeare.txt.gz

# The shipped model's exit gate for adaptive depth's `gate` criterion (docs/adaptive.md; ~1.5 minutes).
gate: $(STAMP)
	$(VENV)/bin/tinyloop train-gate $(MODELS)/tinyloop-16m.tinyloop --threads 2 \
	    $(CORPUS)/brown.txt.gz $(CORPUS)/kjv.txt.gz $(CORPUS)/pydocs.txt.gz $(CORPUS)/shakespeare.txt.gz

clean:
	rm -rf $(VENV) .pytest_cache
