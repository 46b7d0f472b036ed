# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# Both create .venv and install on first use (the stamp files record what was installed).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
HOST    ?= 127.0.0.1
PORT    ?= 8000

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

# The main job: the OpenAI-compatible server on the bundled model.
run: $(VENV)/.installed
	$(BIN)/jaxinfer serve --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-test
	$(BIN)/pytest -n 2 --dist loadfile

clean:
	rm -rf $(VENV) .pytest_cache
