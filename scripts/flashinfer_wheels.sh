#!/usr/bin/env bash
# FlashInfer for the GPU machine (x86-64, Python 3.12, torch 2.11.0+cu130, nvcc 13.0, no
# registry access, at most 64 MiB carried per call). docs/FLASHINFER.md says why two wheels do.
#
# Here (with pip access), from anywhere in the repo:
#   scripts/flashinfer_wheels.sh                 # flashinfer-python 0.6.0 + apache-tvm-ffi
#   FLASHINFER_VERSION=0.6.18.post1 scripts/flashinfer_wheels.sh
# downloads them into .fiwhl/ at the repo root (git-ignored through .git/info/exclude) and
# prints their size against the 64 MiB limit.
#
# There (a device call that carries [".fiwhl"], from the repo root):
#   fi_env=$(bash scripts/flashinfer_wheels.sh install) && eval "$fi_env" && python3 -m pytest -m gpu ...
# installs them into /tmp/fi and prints the exports FlashInfer's JIT needs (PYTHONPATH,
# CUDA_HOME, and where libcuda.so is for its `-lcuda` link) for the eval.
#
# Only two wheels travel: flashinfer-python (Python + the CUDA sources it JIT-compiles with the
# machine's nvcc) and apache-tvm-ffi (the native FFI its kernels are loaded through). The rest
# of flashinfer-python's requirements are either in the GPU image already (numpy, requests,
# tqdm, packaging, nvidia-ml-py, ninja, filelock, jinja2, einops, click, tabulate,
# typing-extensions, cuda-bindings) or never imported by `import flashinfer` and the paged
# decode/prefill wrappers (nvidia-cutlass-dsl, nvidia-cudnn-frontend, cuda-tile, nccl4py).
set -euo pipefail

FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.6.0}
TVM_FFI_VERSION=${TVM_FFI_VERSION:-0.1.15.post2}
PY=${PY:-python3}
DIR=.fiwhl
TARGET=${FI_TARGET:-/tmp/fi}
LIMIT=$((64 * 1024 * 1024))  # what one device call carries: working tree + carried paths

mib() { echo "$1" | awk '{printf "%.1f", $1 / 1048576}'; }

download() {
    cd "$(git rev-parse --show-toplevel)"
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")" "$DIR"
    grep -qxF "/$DIR/" "$exclude" 2>/dev/null || echo "/$DIR/" >>"$exclude"
    rm -f "$DIR"/*.whl  # one version of each: two versions of a wheel stop the install there
    for req in "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION"; do
        "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
            --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
            -d "$DIR" "$req"
    done
    echo "wheels in $DIR/:"
    for w in "$DIR"/*.whl; do echo "  $(mib "$(wc -c <"$w")") MiB  $w"; done
    local wheels tree total verdict
    wheels=$(cat "$DIR"/*.whl | wc -c)
    tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 cat 2>/dev/null | wc -c)
    total=$((wheels + tree))
    verdict=$([ "$total" -le "$LIMIT" ] && echo "fits in one call" || echo "TOO BIG for one call")
    echo "wheels $(mib "$wheels") MiB + working tree $(mib "$tree") MiB = $(mib "$total") MiB" \
        "of the $((LIMIT / 1048576)) MiB one call carries: $verdict"
    echo "on the GPU, in a call that carries [\"$DIR\"]:"
    echo "  fi_env=\$(bash scripts/flashinfer_wheels.sh install) && eval \"\$fi_env\" && python3 -m pytest -q -m gpu tests/test_flashinfer_backend.py"
}

install() {  # stdout: export lines only (for eval); everything else to stderr
    ls "$DIR"/*.whl >/dev/null 2>&1 || { echo "no wheels in $DIR/: carry it" >&2; exit 1; }
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$TARGET" "$DIR"/*.whl >&2
    local cuda_home=${CUDA_HOME:-}
    if [ -z "$cuda_home" ]; then  # the toolkit holding a real nvcc (/usr/local/bin/nvcc may be a wrapper)
        for d in /usr/local/cuda /usr/local/cuda-13.0 "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
            if [ -x "$d/bin/nvcc" ] && ls "$d"/lib64/libcudart.so* >/dev/null 2>&1; then cuda_home=$d; break; fi
        done
    fi
    echo "flashinfer_wheels: CUDA_HOME=${cuda_home:-not found}" >&2
    # FlashInfer links its JIT modules with -L$CUDA_HOME/lib64{,/stubs} -lcudart -lcuda: find a
    # libcuda.so for -lcuda (the toolkit's stub, else the driver's, linked unversioned if need be)
    local ldflags="" lib=""
    for f in "$cuda_home/lib64/stubs/libcuda.so" /usr/local/nvidia/lib64/libcuda.so \
             /usr/lib/x86_64-linux-gnu/libcuda.so /usr/local/nvidia/lib64/libcuda.so.1 \
             /usr/lib/x86_64-linux-gnu/libcuda.so.1 $(ldconfig -p 2>/dev/null | awk '/libcuda\.so/ {print $NF}'); do
        if [ -e "$f" ]; then lib=$f; break; fi
    done
    if [ -z "$lib" ]; then
        echo "flashinfer_wheels: no libcuda.so found; the JIT link (-lcuda) may fail" >&2
    elif [ "${lib##*/}" = libcuda.so ]; then
        ldflags="-L$(dirname "$lib")"
    else
        mkdir -p "$TARGET/cudalink" && ln -sf "$lib" "$TARGET/cudalink/libcuda.so"
        ldflags="-L$TARGET/cudalink"
    fi
    echo "flashinfer_wheels: libcuda for linking: ${lib:-none}" >&2
    echo "export PYTHONPATH=$TARGET:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    [ -n "$cuda_home" ] && echo "export CUDA_HOME=$cuda_home"
    [ -n "$ldflags" ] && echo "export FLASHINFER_EXTRA_LDFLAGS=\"$ldflags\""
    return 0
}

case "${1:-download}" in
    download) download ;;
    install) install ;;
    *) echo "usage: $0 [download|install]" >&2; exit 2 ;;
esac
