# The two commands of the README. torch is pinned first so pip takes the CPU build on disk
# (a bare `torch` requirement would pull a multi-GB CUDA build); the project accepts any torch >= 2.5.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup setup-test demo test bench-cpu

setup:
	$(PIP) "torch==2.13.0"
	$(PIP) -e .

setup-test:
	$(PIP) "torch==2.13.0"
	$(PIP) -e ".[test]"

demo: setup
	rollout demo

test: setup-test
	$(PY) -m pytest -q -p no:cacheprovider --durations=15

bench-cpu: setup-test
	$(PY) benchmarks/decode_throughput.py --shape cpu-small --device cpu --batch-sizes 1 16 64
