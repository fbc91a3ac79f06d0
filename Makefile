# Two commands for a newcomer:  `make demo`  and  `make test`.
# Each creates .venv/ and installs what it needs (torch CPU build first, so that no
# multi-GB CUDA build is pulled in; override TORCH_SPEC for a GPU machine).
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup browser demo test lint bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[all,test]"
	touch $@

setup: $(BIN)/.installed

# The HTML report's tests drive Debian's chromium headless; installed here when missing (root or
# sudo needed; without it those tests are skipped with a message saying so).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ]; then SUDO=""; else SUDO="sudo -n"; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null \
	  || echo "note: could not install chromium; the HTML report's browser tests will be skipped"; }

demo: setup
	$(BIN)/trainprobe demo --out ./trainprobe_demo

lint: setup
	$(BIN)/ruff check src tests bench

test: lint browser
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/bench_monitor_v2.py
	$(BIN)/python bench/bench_monitor_v1.py
	$(BIN)/python bench/bench_metrics.py
	$(BIN)/python bench/bench_dump.py

clean:
	rm -rf $(VENV) trainprobe_demo .pytest_cache
