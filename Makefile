# Two commands on a fresh machine: `make serve` (server on the shipped model) and `make test`.
# Each installs what it needs into the project venv first (torch pinned to the local CPU wheel).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tinyloop serve $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
