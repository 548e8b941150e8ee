# PPO Lab: two commands do all the set-up.
#   make book   build the executed book into _build/html (creates .venv on first use)
#   make test   run every test: unit tests, nbval on the chapters, a clean -W -n build of the book
#   make bench  speed benchmark against TRL's PPOTrainer (creates .venv-bench on first use;
#               see benchmarks/README.md)
#   make student-book  the student edition into _build/student: the HTML and the chapters'
#               notebooks without the exercise solutions, from the executed twins (runs nothing)
# For authors:
#   make twins  regenerate the chapters' .ipynb twins from their .md sources and execute them
#   make sweep  run every chapter under many seeds and write book/sweep.md (hours; resumable)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TWINS  := $(PY) book/_scripts/twins.py

# No test or book build may reach a model hub. (MPLBACKEND is left alone: a notebook kernel
# needs its inline backend, and matplotlib falls back to Agg by itself without a display.)
export HF_HUB_OFFLINE := 1
# The chapters' checks raise here (the build and the tests); in a learner's own kernel a failed
# check prints a note and the notebook goes on (ppo_lab/book.py, `check`).
export PPO_LAB_BOOK_STRICT := 1

.PHONY: book test install twins bench clean student-book sweep

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "PPO Lab needs Python 3.10 or newer; found " + sys.version.split()[0] + " (set PYTHON=/path/to/python3.x)")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

# jupyter-cache keys a chapter on its code cells only, so a change inside ppo_lab would leave
# stale outputs in the book: the cache is dropped whenever the package's sources or the shipped
# tiny model change.
book: $(STAMP)
	@hash=$$(cat ppo_lab/*.py ppo_lab/presets/*.yaml ppo_lab/data/tiny/* requirements.txt | sha256sum | cut -c1-16); \
	if [ "$$(cat _build/.ppo_lab_hash 2>/dev/null)" != "$$hash" ]; then rm -rf _build/.jupyter_cache; fi; \
	mkdir -p _build && echo $$hash > _build/.ppo_lab_hash
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "The book is in _build/html/index.html"

# 1. unit tests (including: every twin matches its source);
# 2. nbval: each chapter re-executed, its outputs compared with the twin's stored ones (cells
#    whose outputs depend on float rounding through a model or a training run are tagged
#    nbval-ignore-output; the hidden checks check them);
# 3. every chapter executed once more under another seed, every check required to pass, so
#    the claims are shown not to rest on the stored run's draws;
# 4. a from-scratch build with -W -n, rendering the outputs nbval just verified (the cache is
#    filled with each chapter as the build reads it, so no chapter runs a second time).
# Tests and chapters run TEST_JOBS at a time (pytest-xdist), each on one thread: a chapter's
# kernel keeps all its cells on one worker (--dist loadfile), and one thread is what the
# chapters and the tests set for themselves anyway, so the numbers are those of a serial run.
OTHER_SEED ?= 1
TEST_JOBS  ?= 2
NBVAL := -p no:cacheprovider -o addopts="" -o testpaths="" -n $(TEST_JOBS) --dist loadfile
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile
	$(PY) -m pytest --nbval $$($(TWINS) list) --nbval-sanitize-with book/_scripts/nbval_sanitize.cfg $(NBVAL)
	PPO_LAB_BOOK_SEED=$(OTHER_SEED) $(PY) -m pytest --nbval-lax $$($(TWINS) list) $(NBVAL)
	rm -rf _build/check
	$(TWINS) cache _build/check/_build/.jupyter_cache
	$(VENV)/bin/jupyter-book build . -W -n --keep-going --path-output _build/check

twins: $(STAMP)
	$(TWINS) sync

# The claims' sweep (book/sweep.md): every page under SWEEP_SEEDS, SWEEP_OTHER once more under
# ATEN_CPU_CAPABILITY=default and 2 threads. Hours on 2 cores; an interrupted sweep resumes.
# SWEEP_JOBS=2 runs two one-thread pages at a time (the 2-thread runs always go one at a time).
SWEEP_SEEDS ?= 53-64
SWEEP_OTHER ?= 53,58,63
SWEEP_JOBS  ?= 1
SWEEP_PAGES ?=
sweep: $(STAMP)
	$(PY) book/_scripts/sweep.py sweep $(SWEEP_PAGES) --seeds $(SWEEP_SEEDS) --jobs $(SWEEP_JOBS) --out book/sweep.jsonl
	$(PY) book/_scripts/sweep.py sweep $(SWEEP_PAGES) --seeds $(SWEEP_OTHER) --threads 2 --aten default --out book/sweep.jsonl
	$(PY) book/_scripts/sweep.py table book/sweep.jsonl --out book/sweep.md

# Built from the twins' stored outputs, so it takes seconds; see book/_scripts/student_edition.py.
student-book: $(STAMP)
	$(PY) book/_scripts/student_edition.py _build/student

# The benchmark has its own venv: TRL 1.12 and its extra dependencies stay out of .venv.
# torch goes first so that pip never resolves it to a CUDA build.
BENCH_VENV  := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed
BENCH_ARGS  ?=

$(BENCH_STAMP): requirements.txt benchmarks/requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "PPO Lab needs Python 3.10 or newer; found " + sys.version.split()[0] + " (set PYTHON=/path/to/python3.x)")'
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(BENCH_VENV)/bin/python -m pip install --quiet -r benchmarks/requirements.txt -e .
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python benchmarks/run.py $(BENCH_ARGS)

clean:
	rm -rf _build
