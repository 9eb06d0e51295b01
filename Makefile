.PHONY: install test lint format bench image

install:  ## CPU machines: the first line takes the CPU build of torch already on disk
	python -m pip install torch==2.13.0
	python -m pip install -e ".[dev,hf]"

test:
	python -m pytest -q -n 2 --dist loadfile

lint:
	ruff check .
	ruff format --check .

format:
	ruff format .
	ruff check --fix .

bench:
	python tools/bench_kernels.py --smoke

image:  ## the CPU image with no registry: a debootstrap base and local wheels (root; minutes)
	tools/container/build_offline.sh
