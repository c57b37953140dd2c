#!/usr/bin/env bash
# On the GPU host (see ../shared/GPU_HOST.md), from the repository root, after the bundle parts
# were copied to $AFD_BUNDLE_DIR (default /tmp/afd-bundle): install the bundle, show the
# installed version, and run the GPU tests (plain vLLM vs AFD on the tiny checkpoints in
# build/models). Logs go to $OUT (at most a handful of files: the device tool returns 8).
set -uo pipefail
OUT=${OUT:-/tmp/afd-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
B=${AFD_BUNDLE_DIR:-/tmp/afd-bundle}
SITE=${AFD_SITE:-/tmp/afd-site}
t0=$(date +%s)
bash "$B/install.sh" "$SITE" > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
echo "install took $(( $(date +%s) - t0 )) s; bundle $(du -cb "$B"/part-* | tail -1 | cut -f1) bytes" \
  | tee -a "$OUT/install.log"
export PYTHONPATH=$SITE
python3 -c "import vllm, importlib.metadata as m; print('import vllm ->', vllm.__version__, '| dist', m.version('vllm'))" 2>&1 \
  | tail -1 | tee "$OUT/version.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/version.log"
rm -rf /tmp/afd-gpu-pt
AFD_MODELS_DIR=$PWD/build/models timeout "${GPU_TEST_TIMEOUT:-480}" \
  python3 -m pytest -m gpu tests/gpu -v -s -p no:cacheprovider --basetemp=/tmp/afd-gpu-pt \
  > "$OUT/gpu_tests.log" 2>&1
rc=$?
tail -25 "$OUT/gpu_tests.log"
tar czf "$OUT/engine_logs.tgz" -C /tmp afd-gpu-pt 2>/dev/null
exit $rc
