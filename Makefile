# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# Both create .venv and install on first use (the stamp files record what was installed).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PROMPT  ?= And God said
MAX_TOKENS ?= 64

.PHONY: run test install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/jaxinfer generate "$(PROMPT)" --max-tokens $(MAX_TOKENS)

test: $(VENV)/.installed-test
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .pytest_cache
