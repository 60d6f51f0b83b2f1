#!/usr/bin/env bash
# Install a built shardtune wheel, with the extras a cluster run needs, into an environment that already holds its
# torch (a cluster's CUDA build, the image's, or the lock's CPU build here): pip only confirms that torch is inside
# pyproject.toml's range and never replaces it. The one list of install commands: docker/Dockerfile runs this file,
# and tests/e2e/test_wheel_install.py runs it into a fresh venv and checks that no torch file changed.
#
#   scripts/install_wheel.sh PYTHON WHEEL [EXTRAS]     # EXTRAS default: deepspeed,metrics,ray
set -euo pipefail
PYTHON="$1"
WHEEL="$2"
EXTRAS="${3:-deepspeed,metrics,ray}"

# No torch yet would let pip pick one from the index: a multi-GB build that may not match the machine's driver.
"$PYTHON" -c "import importlib.metadata as m; print('torch', m.version('torch'), 'stays')" \
  || { echo "install_wheel.sh: install torch into this environment first (its CUDA build fits the driver)" >&2; exit 2; }
# DeepSpeed installs from source; its ops compile on first use (DS_BUILD_OPS=0), as make setup does.
DS_BUILD_OPS=0 "$PYTHON" -m pip install --no-cache-dir "${WHEEL}[${EXTRAS}]"
