# Two commands for a newcomer:  `make demo`  and  `make test`.
# Each creates .venv/ and installs what it needs (torch CPU build first, so that no
# multi-GB CUDA build is pulled in; override TORCH_SPEC for a GPU machine).
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup browser demo test pytest-torch test-torch test-gpu test-mindspore test-spark interop interop-list lint bench bench-query clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[all,test]"
	touch $@

setup: $(BIN)/.installed

# MindSpore (the second backend) is built against NumPy 1.x, while the rest of the suite runs on
# NumPy 2: mindspore goes into .venv (it changes nothing there), and .venv/ms is a small overlay
# virtualenv holding only numpy<2 that sees everything else in .venv.
MS_BIN := $(VENV)/ms/bin
$(MS_BIN)/.installed: $(BIN)/.installed
	$(BIN)/python -m pip install -q "mindspore>=2.4.10"
	test -x $(MS_BIN)/python || $(PY) -m venv $(VENV)/ms
	$(MS_BIN)/python -m pip install -q "numpy<2"
	$(BIN)/python -c "import sysconfig; print('import site; site.addsitedir(%r)' % sysconfig.get_paths()['purelib'])" \
	  > "$$($(MS_BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/trainprobe_base.pth"
	touch $@

# The HTML report's tests drive Debian's chromium headless; installed here when missing (root or
# sudo needed; without it those tests are skipped with a message saying so).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ]; then SUDO=""; else SUDO="sudo -n"; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null \
	  || echo "note: could not install chromium; the HTML report's browser tests will be skipped"; }

demo: setup
	$(BIN)/trainprobe demo --out ./trainprobe_demo --overwrite

# ruff, and mypy over src/trainprobe (its settings, strict on the framework-free core: pyproject.toml)
lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

# Every phase runs, whatever the earlier ones gave (.ci/phases.sh), then one line per phase says
# passed or FAILED and its time, and the total; the exit status is 1 when any phase failed. On 2
# CPU cores the PyTorch suite takes ~13 min and the whole ~20 min once installed; the first run
# installs too (the MindSpore and interop phases make their virtualenvs: a failed install is that
# phase failing).
MAKE_PHASE = $(MAKE) --no-print-directory
test: setup browser
	@.ci/phases.sh "lint=$(MAKE_PHASE) lint" "PyTorch suite=$(MAKE_PHASE) pytest-torch" \
	  "MindSpore suite=$(MAKE_PHASE) test-mindspore" "interop=$(MAKE_PHASE) interop"

# the PyTorch suite alone (no lint, no browser install)
pytest-torch: setup
	$(BIN)/python -m pytest -q --ignore-glob='tests/test_mindspore_*' --ignore=tests/interop

# PyTorch only: no MindSpore install, no reference virtualenv (CI runs `make test`, everything).
test-torch: lint browser
	@$(MAKE_PHASE) pytest-torch

# The differential test against the reference tool (tests/interop, docs/compatibility.md). The
# reference (mindstudio-probe) is a test oracle only: it lives in its own virtualenv .venv-ref,
# with the same torch installed first (so that nothing pulls another build), and is never a
# dependency of trainprobe. `make interop-list` prints the differences found now as the table of
# docs/compatibility.md.
REF_VENV ?= .venv-ref
REF_SPEC ?= mindstudio-probe==26.2.0
REF_BIN := $(REF_VENV)/bin
REF_PYTHON = $(abspath $(REF_BIN))/python

$(REF_BIN)/.installed:
	test -x $(REF_BIN)/python || $(PY) -m venv $(REF_VENV)
	$(REF_BIN)/python -m pip install -q --upgrade pip
	$(REF_BIN)/python -c "import torch" 2>/dev/null || $(REF_BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(REF_BIN)/python -m pip install -q "$(REF_SPEC)"
	touch $@

interop: setup $(REF_BIN)/.installed
	TRAINPROBE_REF_PYTHON=$(REF_PYTHON) $(BIN)/python -m pytest -q tests/interop

interop-list: setup $(REF_BIN)/.installed
	@TRAINPROBE_REF_PYTHON=$(REF_PYTHON) $(BIN)/python tests/interop/list_differences.py

# The query layer on Apache Spark (tests/test_query_spark.py; skipped in `make test`): pyspark is a
# ~320 MB download built on install, and each Spark start in local mode takes 30 s to 2 min on a
# 2-core machine, too much for every CI run; Java 17+ must be installed.
test-spark: setup
	$(BIN)/python -m pip install -q -e ".[spark]"
	$(BIN)/python -m pytest -q tests/test_query_spark.py

# The GPU checks (issue #25), on a machine with an NVIDIA GPU, e.g. `make test-gpu TORCH_SPEC=torch`:
# when the torch in .venv cannot use the GPU, TORCH_SPEC (a CUDA build) replaces it (only this
# target does that; setup and test keep the build they installed). Then the cuda params of the
# device-parametrised tests (tests/test_device_*.py and the CUDA tests of test_stats.py and
# test_dump_checksums.py; NCCL ones with 2+ GPUs) and the GPU benchmarks. bench/gpu_check.sh is
# the same in ~8 minutes with small sizes, installing nothing.
GPU_TESTS := tests/test_device_e2e.py tests/test_device_copy.py tests/test_device_nccl.py tests/test_stats.py tests/test_dump_checksums.py
test-gpu: setup
	$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || \
	  { $(BIN)/python -m pip uninstall -q -y torch && $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; }
	@$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
	  'test-gpu: torch ' + torch.__version__ + ' sees no CUDA device: run on a GPU machine with TORCH_SPEC=<a CUDA build>')"
	$(BIN)/python -m pytest -q -rs -k "cuda or nccl or device_row or device_tensors" $(GPU_TESTS)
	$(BIN)/python bench/bench_paired.py --device cuda --model gpu --pairs 20
	$(BIN)/python bench/bench_paired.py --device cuda --model gpu --pairs 20 --configs control,v2-wg+opt+param,v2-module,dump-L0 --fused-stats auto
	$(BIN)/python bench/bench_fused_stats.py --device cuda

test-mindspore: $(MS_BIN)/.installed
	$(MS_BIN)/python -m pytest -q tests/test_mindspore_*.py

bench: setup
	$(BIN)/python bench/bench_monitor_v2.py
	$(BIN)/python bench/bench_monitor_v1.py
	$(BIN)/python bench/bench_metrics.py
	$(BIN)/python bench/bench_dump.py
	$(BIN)/python bench/bench_paired.py

# the query layer's targets (bench/bench_query.py: synthetic runs of 3.2 M rows as CSV, 100 M as Parquet)
bench-query: setup
	$(BIN)/python bench/bench_query.py

clean:
	rm -rf $(VENV) $(REF_VENV) trainprobe_demo .pytest_cache
