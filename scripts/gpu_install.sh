#!/usr/bin/env bash
# Install a vLLM-AFD offline bundle on the GPU host (no package index needed).
#   ./install.sh [TARGET_DIR]      (default: ./afd-site next to this script)
# Checks every part against MANIFEST.sha256, joins them, checks the joined tar, unpacks it and
# runs `pip install --no-index --no-deps --target TARGET_DIR` on the wheels. Changes nothing
# global: it writes TARGET_DIR/afd-env.sh (PYTHONPATH and the GPU host's variables) to source.
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
# pip --target does not run the .pth files it installs (a site-packages folder would): the
# folders they add to sys.path (e.g. the CuTe DSL's nvidia_cutlass_dsl/dsl_packages, where
# vLLM 0.34.0's `cutlass` lives) go on PYTHONPATH after TARGET.
PTH="$("$PY" -c "import site, sys; b = list(sys.path); site.addsitedir(sys.argv[1]); print(''.join(':' + p for p in sys.path if p not in b and p != sys.argv[1]))" "$TARGET")"
{
  echo "# written by install.sh: source it to use this bundle"
  echo "export PYTHONPATH=$TARGET$PTH\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
} > "$TARGET/afd-env.sh"
echo
echo "installed into $TARGET. Use it with:"
echo "  source $TARGET/afd-env.sh"
echo "which sets:"
tail -n +2 "$TARGET/afd-env.sh"
