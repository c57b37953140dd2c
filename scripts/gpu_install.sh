#!/usr/bin/env bash
# Install a vLLM-AFD offline bundle on the GPU host (no package index needed).
#   ./install.sh [TARGET_DIR]      (default: ./afd-site next to this script)
# Checks every part against MANIFEST.sha256, joins them, checks the joined tar, unpacks it and
# runs `pip install --no-index --no-deps --target TARGET_DIR` on the wheels. Changes nothing
# global: it only prints the PYTHONPATH line to use.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TARGET="$(realpath -m "${1:-$HERE/afd-site}")"
PY="${PYTHON:-python3}"
cd "$HERE"
echo "checking parts against MANIFEST.sha256"
sha256sum --quiet -c MANIFEST.sha256
WORK="$(mktemp -d "${TMPDIR:-/tmp}/afd-bundle.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
cat $(awk '{print $2}' MANIFEST.sha256 | grep '^part-' | sort) > "$WORK/bundle.tar"
(cd "$WORK" && sha256sum --quiet -c "$HERE/bundle.tar.sha256")
tar -xf "$WORK/bundle.tar" -C "$WORK"
mkdir -p "$TARGET"
"$PY" -m pip install --no-index --no-deps --disable-pip-version-check --target "$TARGET" \
    "$WORK"/payload/wheels/*.whl $(ls "$WORK"/payload/deps/*.whl 2>/dev/null || true)
echo
echo "installed into $TARGET. Use it with:"
echo "  export PYTHONPATH=$TARGET\${PYTHONPATH:+:\$PYTHONPATH}"
echo "  export VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
