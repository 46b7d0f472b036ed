# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# Both create .venv and install on first use (the stamp files record what was installed).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
HOST    ?= 127.0.0.1
PORT    ?= 8000

.PHONY: run test test-gpu install clean

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
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder

# The tests of device code (pytest -m device: kernels, the engine with attention="pallas", quantized,
# fp8 and W8A8 matmuls) compiled on a GPU, with the machine's own Python: a GPU image has jax with its
# CUDA plugin installed (pip install -e '.[cuda13]'), and may have no network for a venv.
# GPU_WORKERS pytest-xdist processes share the GPU, each with a quarter of its memory (JAX would take
# 75% in one; XLA_CLIENT_MEM_FRACTION, and XLA_PYTHON_CLIENT_MEM_FRACTION, its older name): the run
# is compile-bound (Triton and XLA compiles on the host's cores; 129 of the 159 tests took 330 s in
# one process on an H200 machine of 16 cores); GPU_WORKERS=0: one process.
# only the files that hold device tests: the others import the server's packages (fastapi,
# uvicorn, pydantic, jsonschema), which a GPU image need not have
GPU_WORKERS ?= 3
test-gpu:
	JAX_PLATFORMS=cuda JAXINFER_TEST_GPU=1 XLA_CLIENT_MEM_FRACTION=0.25 XLA_PYTHON_CLIENT_MEM_FRACTION=0.25 \
		$(PY) -m pytest -m device -p no:cacheprovider -o addopts="" -q --durations=15 \
		$(if $(filter 0,$(GPU_WORKERS)),,-n $(GPU_WORKERS)) \
		$(shell grep -l "pytest.mark.device" tests/test_*.py)

clean:
	rm -rf $(VENV) .pytest_cache
