# batchfleet: `make demo` runs the main job on simulated GPUs; `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Test processes (pytest-xdist): the end-to-end tests mostly wait on simulated servers and leases, so
# four share two cores well. TEST_JOBS=0 runs everything in this one process.
TEST_JOBS ?= 4

.PHONY: install demo test test-quick lint bench clean acl

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,report,zstd]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/python scripts/demo.py

test: install
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n $(TEST_JOBS) --dist worksteal

# For iteration: everything but the end-to-end scenarios (marked slow). `make test` runs everything.
test-quick: install
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n $(TEST_JOBS) --dist worksteal -m "not slow"

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python bench/bench_enqueue.py
	$(BIN)/python bench/bench_dispatch.py
	$(BIN)/python bench/bench_window.py --n 200000
	$(BIN)/python bench/bench_fill.py
	$(BIN)/python bench/bench_tail.py

# Redis ACL users, one per role (see docs/security.md): users.acl for `redis-server --aclfile`, and the
# passwords (random on first use, kept after) in users.passwords, both mode 0600.
acl: install
	$(BIN)/python -m batchfleet.acl --passwords users.passwords --out users.acl
	@echo "wrote users.acl and users.passwords (0600); load with: redis-server --aclfile $$PWD/users.acl"

clean:
	rm -rf var/ .batchfleet/ .pytest_cache/ .ruff_cache/
