# The two commands of the README: `make run` and `make test`. Both install first, from nothing.
VENV   ?= .venv
PYTHON ?= python3
HPCDL  := $(VENV)/bin/hpcdl
DATA   ?= data/hep
EVENTS ?= 25000
NODES  ?= 2
# One node per group: two groups and the applier on this machine, to show the hybrid mode. Without
# stragglers a synchronous group is as fast or faster (docs/results.md, "When groups pay"):
# GROUP_SIZE=2 trains one synchronous group instead.
GROUP_SIZE ?= 1
STEPS  ?= 600
# The paper's network is 128 filters wide (the job default); 32 keeps `make run` to minutes on 2 cores.
FILTERS ?= 32
# MPI=1: build Horovod with MPI beside Gloo (run.controller = "mpi"; README, Installation).
MPI ?= 0
INSTALLED := $(VENV)/.installed$(if $(filter 1,$(MPI)),-mpi)

.PHONY: install run test test-fast bench docs clean resolve-wheels

install: $(INSTALLED)

# An MPI build serves both controllers, so a later plain `make install` keeps it.
$(VENV)/.installed $(VENV)/.installed-mpi: pyproject.toml scripts/install.sh
	VENV=$(VENV) PYTHON=$(PYTHON) HPCDL_MPI=$(if $(filter %-mpi,$@),1,0) bash scripts/install.sh

# Generate a small synthetic HEP set, train $(NODES) ranks in groups of $(GROUP_SIZE) with the applier
# between them on this machine, then score the master weights against the physics selection.
run: install
	@test -f $(DATA)/test.h5 || $(HPCDL) data generate hep --out $(DATA) --events $(EVENTS) --image-size 64
	$(HPCDL) submit hep --backend local --nodes $(NODES) --group-size $(GROUP_SIZE) --set train.steps=$(STEPS) --set model.filters=$(FILTERS) \
	    --set 'data.train="$(DATA)/train.h5"' --set 'data.test="$(DATA)/test.h5"' --set 'data.val="$(DATA)/val.h5"'
	$(HPCDL) evaluate --data $(DATA)/test.h5

# The whole suite, SLURM and MPI integration tests included (they start a real local cluster and
# real mpirun/srun --mpi jobs), so it installs the MPI build and fails where MPI cannot run.
test: $(VENV)/.installed-mpi
	HPCDL_REQUIRE_MPI=1 VENV=$(VENV) bash scripts/test.sh

# Unit tests only: no SLURM daemons, no long training.
test-fast: install
	$(VENV)/bin/python -m pytest -q -m "not slow and not slurm"

bench: install
	$(VENV)/bin/python -m bench

# The generated reference pages and the docs' pictures, redrawn from the code and bench/results/.
docs: install
	$(VENV)/bin/python -m hpcdl.reference
	$(VENV)/bin/python -m docs.figures

# Whether every dependency has a wheel for another Python (e.g. PYVER=3.13) without installing it.
PYVER ?= 3.13
resolve-wheels:
	PY=$(PYTHON) bash scripts/resolve-wheels.sh $(PYVER)

clean:
	rm -rf $(VENV) runs data .pytest_cache
