# `make demo` and `make test` do all the set-up: a .venv from a Python >= 3.12 found on PATH or
# under pyenv, the package installed into it with its test extras.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
XLA_VENV := .venv-xla
PROMPT ?= The "if" statement is used for conditional execution:
export PROMPT   # reaches the recipe through the environment: any quotes in it stay text
NEW ?= 200

define find_python
for p in python3.14 python3.13 python3.12 python3 python $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3 \
         $${PYENV_ROOT:-/nonexistent}/versions/3.1[2-9]*/bin/python3; do \
  if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
    echo $$p; exit 0; fi; done; echo "no Python >= 3.12 on PATH or under pyenv" >&2; exit 1
endef

# A venv's packages come in two steps: the dependencies pyproject.toml lists for it, then the project
# itself (editable). Only the second writes into the source tree (jtilert.egg-info), so it runs under a
# lock on pyproject.toml: the two venvs install side by side (`make -j2 install xla-venv`).
define pip_install
$(1) -m pip install -q --upgrade pip
$(1) -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"][sys.argv[1]]))' $(2) > $(3)/requirements.txt
$(1) -m pip install -q -r $(3)/requirements.txt
flock pyproject.toml $(1) -m pip install -q -e '.[$(2)]'
endef

$(VENV)/.installed: pyproject.toml
	@py=$$($(find_python)) && echo "using $$py" && $$py -m venv $(VENV)
	$(call pip_install,$(PY),test,$(VENV))
	touch $@

# XLA's GPU compiler without a GPU: the project with jax's CUDA plugin (bench/xla_kernels.py), in a
# venv of its own so that the tests' and the demo's jax never sees a CUDA plugin
$(XLA_VENV)/.installed: pyproject.toml
	@py=$$($(find_python)) && echo "using $$py" && $$py -m venv $(XLA_VENV)
	$(call pip_install,$(XLA_VENV)/bin/python,xla,$(XLA_VENV))
	touch $@

.PHONY: demo test install xla-venv xla-kernels
install: $(VENV)/.installed
xla-venv: $(XLA_VENV)/.installed

# the 61-layer step's kernels a call as XLA compiles it for an H200 (bench/RESULTS.md, session 31)
xla-kernels: $(XLA_VENV)/.installed
	$(XLA_VENV)/bin/python -m bench.xla_kernels --layers 61

demo: $(VENV)/.installed
	$(VENV)/bin/jtilert generate --model tiny --mtp --max-new-tokens $(NEW) --prompt "$$PROMPT"

# the tests spread over one worker process per core (pytest-xdist); the slowest listed, to keep the suite short
test: $(VENV)/.installed
	$(PY) -m pytest -p no:cacheprovider -n auto --dist load --durations=15
