# Two commands a fresh machine needs: `make demo` (the main job) and `make test`.
# Both create .venv at the repo root themselves.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: demo test lint bench system-deps clean

$(STAMP): pyproject.toml setup.py
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch==2.13.0 is a CPU build on these machines; pinning it first keeps pip from a CUDA build
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# Stores the tests start themselves (Debian packages; the tests never assume a running server).
system-deps:
	@command -v redis-server >/dev/null && command -v etcd >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server etcd-server >/dev/null; }

demo: $(STAMP)
	$(VENV)/bin/sdcp-fast demo

test: $(STAMP) system-deps
	$(VENV)/bin/ruff check .
	TRITON_INTERPRET=1 $(VPY) -m pytest -q

# Speed lives here, never in tests: each script prints what it measured side by side.
bench: $(STAMP)
	$(VPY) -m pytest bench/bench_kernels.py -q --benchmark-only -o python_files='bench_*.py'
	$(VPY) bench/bench_cache.py
	$(VPY) bench/bench_transport.py
	$(VPY) bench/bench_models.py
	$(VPY) bench/bench_verifier.py
	$(VPY) bench/bench_demo.py
	$(VPY) bench/bench_decode.py
	$(VPY) bench/bench_session_memory.py
	$(VPY) bench/bench_hostile.py

clean:
	rm -rf $(VENV) build *.egg-info
