# `make demo` and `make test` do all set-up themselves on a fresh machine.
VENV ?= .venv
BIN := $(VENV)/bin

$(BIN)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# Pinned so pip takes the local CPU wheel and never pulls CUDA wheels.
	$(BIN)/pip install --quiet torch==2.13.0 -e '.[test,docs]'
	touch $@

# The browser tests (tests/test_tensorboard.py) drive Debian's Chromium: installed here when
# we are root, as CI is (elsewhere they skip without it). They serve the profiler's Trace view
# the webcomponents polyfill that it would load from a CDN, unpacked from its npm package.
WEBCOMPONENTS := .vendor/webcomponents.js-0.7.24/webcomponents.min.js

browser: $(WEBCOMPONENTS)
	@command -v chromium >/dev/null || [ "$$(id -u)" -ne 0 ] || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

$(WEBCOMPONENTS):
	@command -v npm >/dev/null || { echo "npm not found: the Trace view test will skip"; exit 0; }; \
	mkdir -p $(@D) && cd $(@D) && npm pack --silent webcomponents.js@0.7.24 >/dev/null && \
	tar -xzf webcomponents.js-0.7.24.tgz --no-same-owner --strip-components=1 package/webcomponents.min.js && \
	rm webcomponents.js-0.7.24.tgz

.PHONY: demo test docs browser conformance clients gpu-check elastic-trials suite
demo: $(BIN)/.installed  ## every stage, compute-only and torch DDP on 2 CPU Gloo ranks
	$(BIN)/torchrun --standalone --nproc-per-node 2 -m stages --model cnn --steps 10

test: $(BIN)/.installed browser  ## lint, the whole suite, and the strict docs build
	$(BIN)/ruff check .
	# One worker per core (at most 4), a test file per worker at a time: most tests wait on
	# processes they start (torchrun, Gloo ranks, a browser), so a lone pytest leaves a core idle.
	# The suite builds the docs with `mkdocs build --strict` (tests/test_docs_site.py).
	# The longest files go first (pytest collects each file once), so that no worker is
	# left with a long one while the others have finished.
	$(BIN)/pytest --numprocesses auto --maxprocesses 4 --dist loadfile $(LONGEST_FIRST) tests

# The test files that take longest on 2 cores, longest first (`pytest --durations`).
LONGEST_FIRST := tests/test_suite.py tests/test_docs_site.py tests/test_tensorboard.py \
	tests/test_conformance.py tests/test_resume.py tests/test_torchrun.py \
	tests/test_command_line.py tests/test_cluster.py tests/test_simulate_user_model.py

# The one suite with more examples than CI draws: DDP_STAGES_EXAMPLES per stage (default
# 1000), every stage and torch's DDP against one process. About 30 minutes on 2 cores.
suite: $(BIN)/.installed  ## the property suite with 1000 examples per stage
	DDP_STAGES_EXAMPLES=$${DDP_STAGES_EXAMPLES:-1000} $(BIN)/pytest -q tests/test_suite.py

docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve -a 127.0.0.1:8000

# torch's own DDP tests (shipped in the wheel), CPU Gloo, 2 ranks: with torch's DDP, then with
# the drop-in swapped in, and a comparison that fails if the drop-in fails one that torch's
# passes (less those that read torch's internals). About 15 minutes on 2 cores each.
conformance: $(BIN)/.installed  ## torch's own DDP tests against the drop-in
	mkdir -p runs/conformance
	-DDP=torch $(BIN)/pytest -q -p no:cacheprovider tests/conformance/torch_suite.py --junitxml=runs/conformance/torch.xml
	-DDP=ours $(BIN)/pytest -q -p no:cacheprovider tests/conformance/torch_suite.py --junitxml=runs/conformance/ours.xml
	$(BIN)/python -m tests.conformance.outcomes runs/conformance/torch.xml runs/conformance/ours.xml

# accelerate's own test scripts, Lightning's Trainer (four DDP variants) and Fabric, and a
# plain DDP script, on CPU Gloo with 2 ranks: each with torch's DDP, then with the drop-in
# swapped in (python -m stages.swap); fails if the drop-in fails one that torch's passes.
clients: $(BIN)/.installed  ## accelerate and Lightning flows, torch's DDP against the drop-in
	$(BIN)/pip install --quiet torch==2.13.0 -e '.[clients]'
	$(BIN)/python -m tests.clients.run

# Every check that needs a CUDA GPU: tests/test_cuda.py, torch's mixed_precision against
# the drop-in's, the drop-in's overhead on ResNet-50 and GPT-2 sized models, the simulator's
# iteration measured on the GPU; each with a time limit, so that the whole stops within 8
# minutes (sized for one H200: about 6 expected, not yet measured there). Without a GPU it
# stops at once, saying so.
gpu-check: $(BIN)/.installed  ## every GPU check, figures in runs/gpu-check/results.md
	$(BIN)/python -m tests.gpu_check --out runs/gpu-check

# Losing a server: 10 trials per policy of an elastic run on the virtual cluster (2 nodes x 2
# ranks; needs root), node 1 killed at a random step; prints the tables of
# docs/when-a-server-is-lost.md, and writes them there with OUT=docs/results. About 25
# minutes on 2 cores.
elastic-trials: $(BIN)/.installed  ## lose a node of an elastic run: 10 trials per policy
	$(BIN)/python -m profiling.studies.elastic_trials --trials 10 --seed 1 \
		--policy keep-global-batch $(if $(OUT),--out $(OUT)/elastic-keep-global-batch.md)
	$(BIN)/python -m profiling.studies.elastic_trials --trials 10 --seed 1 \
		--policy scale-lr $(if $(OUT),--out $(OUT)/elastic-scale-lr.md)
