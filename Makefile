# Two commands for a newcomer: `make demo` (the two-region demo) and `make test`.
# Both create .venv with Python 3.11 on first use and reinstall only when
# pyproject.toml changes.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) experiments/demo_two_region.py $(ARGS)

# pytest exits 5 when it collects nothing; for this suite that means a broken
# collection, so it is reported and turned into a failure.
test: $(STAMP)
	@$(PY) -m pytest -q $(ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; \
	exit $$status

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(ARGS)

clean:
	rm -rf $(VENV) runs
