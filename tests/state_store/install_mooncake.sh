#!/usr/bin/env bash
# Installs what tests/state_store/test_mooncake.py needs on a fresh Debian machine: the RDMA user-space
# libraries that Mooncake's extension links against (even for TCP), and the CPU-only Mooncake wheel
# (which also ships the mooncake_master and mooncake_client binaries). Idempotent and quiet: it installs
# only what is missing and ends by loading the extension, so a failure is loud.
# Environment: PYTHON (default: python), MOONCAKE_VERSION (default below).
set -euo pipefail

PYTHON="${PYTHON:-python}"
MOONCAKE_VERSION="${MOONCAKE_VERSION:-0.3.13.post1}"
APT_PACKAGES=(libibverbs1 librdmacm1)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

installed="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("mooncake-transfer-engine-non-cuda"))' \
  2>/dev/null || true)"
if [ "$installed" != "$MOONCAKE_VERSION" ]; then
  "$PYTHON" -m pip install -q --disable-pip-version-check "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
fi

"$PYTHON" -c 'import mooncake.store'
