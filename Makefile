# `make demo` and `make test` do all the set-up: a .venv from a Python >= 3.12 found on PATH or
# under pyenv, the package installed into it with its test extras.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PROMPT ?= The "if" statement is used for conditional execution:
export PROMPT   # reaches the recipe through the environment: any quotes in it stay text
NEW ?= 200

define find_python
for p in python3.14 python3.13 python3.12 python3 python $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3 \
         $${PYENV_ROOT:-/nonexistent}/versions/3.1[2-9]*/bin/python3; do \
  if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
    echo $$p; exit 0; fi; done; echo "no Python >= 3.12 on PATH or under pyenv" >&2; exit 1
endef

$(VENV)/.installed: pyproject.toml
	@py=$$($(find_python)) && echo "using $$py" && $$py -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: demo test install
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/jtilert generate --model tiny --mtp --max-new-tokens $(NEW) --prompt "$$PROMPT"

# the tests spread over one worker process per core (pytest-xdist)
test: $(VENV)/.installed
	$(PY) -m pytest -p no:cacheprovider -n auto --dist load
