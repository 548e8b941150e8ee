# PPO Lab: two commands do all the set-up.
#   make book   build the executed book into _build/html (creates .venv on first use)
#   make test   run every test: unit tests, and a clean build of the book with -W -n
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# No test or book build may reach a model hub; plots render without a display.
export HF_HUB_OFFLINE := 1
export MPLBACKEND := Agg

.PHONY: book test install clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "PPO Lab needs Python 3.10 or newer; found " + sys.version.split()[0] + " (set PYTHON=/path/to/python3.x)")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "The book is in _build/html/index.html"

# The book check builds from scratch into its own folder: an incremental build hides the
# warnings of pages that did not change.
test: $(STAMP)
	$(PY) -m pytest
	rm -rf _build/check
	$(VENV)/bin/jupyter-book build . -W -n --keep-going --path-output _build/check

clean:
	rm -rf _build
