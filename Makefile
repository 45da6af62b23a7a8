PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run run-once test lint bench screenshots clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) node_modules/.package-lock.json

# --ignore-scripts: the packages are plain files; no install script runs (swagger-ui-dist's @scarf/scarf
# would report the install to scarf.sh)
node_modules/.package-lock.json: package.json package-lock.json
	npm ci --no-audit --no-fund --ignore-scripts

run: install
	bash scripts/test-setup.sh run
	$(BIN)/corral serve --demo

run-once: install
	bash scripts/test-setup.sh run
	$(BIN)/corral run --json run-report.json

test: install
	bash scripts/test-setup.sh
	$(BIN)/ruff check app workers tests benchmarks
	$(BIN)/mypy app
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check app workers tests benchmarks
	$(BIN)/ruff format --check app workers tests benchmarks
	$(BIN)/mypy app

bench: install
	$(BIN)/corral bench --json bench.json --plot docs/ladder.png

screenshots: install
	bash scripts/test-setup.sh
	CORRAL_SCREENSHOTS=docs/screenshots $(BIN)/pytest -q tests/web/test_browser.py -k screenshots

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
