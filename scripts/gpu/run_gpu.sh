#!/usr/bin/env bash
# On the GPU host (docs/gpu-tests.md), from the repository root, after the bundle parts
# were copied to $AFD_BUNDLE_DIR (default /tmp/afd-bundle): install the bundle, show the
# installed version, and run the GPU tests (plain vLLM vs AFD on the tiny checkpoints in
# build/models) and the benchmarks asked for. Logs go to $OUT (a handful of files per run).
set -uo pipefail
OUT=${OUT:-/tmp/afd-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
B=${AFD_BUNDLE_DIR:-/tmp/afd-bundle}
SITE=${AFD_SITE:-/tmp/afd-site}
t0=$(date +%s)
if [ -f "$SITE/.afd-installed" ]; then
  echo "bundle already installed in $SITE (warm machine)" | tee "$OUT/install.log"
else
  bash "$B/install.sh" "$SITE" > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
  touch "$SITE/.afd-installed"
  echo "install took $(( $(date +%s) - t0 )) s; bundle $(du -cb "$B"/part-* | tail -1 | cut -f1) bytes" \
    | tee -a "$OUT/install.log"
fi
# PYTHONPATH: the bundle's folder and the folders of its .pth files (install.sh wrote them)
# shellcheck disable=SC1091
source "$SITE/afd-env.sh"
# A bundle that carries its own torch (a line whose torch differs from the host's, e.g. vLLM
# 0.34.0: targets/X/gpu_host_deps.txt) brings the NCCL that torch needs and uses the host's
# other CUDA libraries: the bundle's NCCL first, then the host's nvidia/*/lib folders.
if [ -d "$SITE/torch" ]; then
  host_nv=$(env -u PYTHONPATH python3 -c "import nvidia, sys; sys.stdout.write(list(nvidia.__path__)[0])" 2>/dev/null)
  libs=$(ls -d "$SITE"/nvidia/*/lib "$host_nv"/*/lib 2>/dev/null | paste -sd:)
  export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "bundle carries torch: LD_LIBRARY_PATH=$LD_LIBRARY_PATH" | tee -a "$OUT/install.log"
fi
python3 -c "import torch, vllm, importlib.metadata as m; print('import vllm ->', vllm.__version__, '| dist', m.version('vllm'), '| torch', torch.__version__, torch.__file__)" 2>&1 \
  | tail -1 | tee "$OUT/version.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/version.log"
rm -rf /tmp/afd-gpu-pt
# GPU_TESTS: pytest selection (default: all GPU tests; "none" skips them); LOG: name of
# this run's log files.
LOG=${LOG:-gpu_tests}
rc=0
# MPS=1: CUDA MPS (benchmarks/mps.py) - the GPU tests run under a control daemon started and
# stopped around them, and the benchmarks get --mps (they start and stop their own).
MPS=${MPS:-0}
if [ "$MPS" = 1 ]; then
  BENCH_ARGS=${BENCH_ARGS:+$BENCH_ARGS --mps}
  SERVE_ARGS=${SERVE_ARGS:+$SERVE_ARGS --mps}
fi
if [ "${GPU_TESTS:-}" != "none" ]; then
  if [ "$MPS" = 1 ]; then
    eval "$(python3 benchmarks/mps.py start)" || exit 1
    echo "GPU tests under CUDA MPS ($CUDA_MPS_PIPE_DIRECTORY)"
  fi
  # shellcheck disable=SC2086
  AFD_MODELS_DIR=$PWD/build/models timeout "${GPU_TEST_TIMEOUT:-480}" \
    python3 -m pytest -m gpu ${GPU_TESTS:-tests/gpu} -v -s -p no:cacheprovider \
    --basetemp=/tmp/afd-gpu-pt-$LOG > "$OUT/$LOG.log" 2>&1
  rc=$?
  [ "$MPS" = 1 ] && { python3 benchmarks/mps.py stop; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
  grep -E "^ORACLE|PASSED|FAILED|ERROR|passed|failed" "$OUT/$LOG.log" | tail -40
  tar czf "$OUT/$LOG-engine-logs.tgz" -C /tmp "afd-gpu-pt-$LOG" 2>/dev/null
fi
# One benchmark script on the DeepSeek-V2-Lite shape (dummy weights; SHAPE_SET: more config
# keys for make_shape.py --set, e.g. '{"num_hidden_layers": 14}' to fit M engines on an H100): KIND (bench|serve)
# names its files $OUT/KIND-$LOG.{log,json} and KIND-$LOG-logs.tgz (the engines' logs, not
# the traces, for a failure's root cause); SCRIPT, TIMEOUT, then the script's arguments.
shape_bench() {
  local kind=$1 script=$2 limit=$3
  shift 3
  python3 benchmarks/make_shape.py --preset deepseek-v2-lite --out /tmp/afd-dsv2-lite \
    ${SHAPE_SET:+--set "$SHAPE_SET"} > "$OUT/$kind-$LOG.log" 2>&1
  rm -rf "/tmp/afd-$kind-$LOG"
  timeout "$limit" python3 "benchmarks/$script" --model /tmp/afd-dsv2-lite \
    --load-format dummy --device cuda "$@" --json "$OUT/$kind-$LOG.json" \
    --log-dir "/tmp/afd-$kind-$LOG" >> "$OUT/$kind-$LOG.log" 2>&1
  local brc=$?
  (cd /tmp && find "afd-$kind-$LOG" -name '*.log' -print0 | tar czf "$OUT/$kind-$LOG-logs.tgz" --null -T -)
  tail -40 "$OUT/$kind-$LOG.log"
  [ "$rc" -eq 0 ] && rc=$brc
}
# BENCH_ARGS: arguments of benchmarks/decode.py, e.g. "--batches 16,64,256 --modes
# plain,afd --connector cuda_ipc --breakdown 16 --compilation-config '{\"cudagraph_mode\":
# \"FULL_DECODE_ONLY\"}'"; figures and the breakdown to $OUT/bench-$LOG.{log,json}.
if [ -n "${BENCH_ARGS:-}" ]; then
  eval "set -- $BENCH_ARGS"
  shape_bench bench decode.py "${BENCH_TIMEOUT:-540}" --dtype bfloat16 "$@"
fi
# SERVE_ARGS: arguments of benchmarks/serve.py (OpenAI API, vllm bench serve), e.g.
# "--modes plain,afd,afd_dbo,plain_x2 --num-prompts 64 --input-len 64 --output-len 256
# --connector cuda_ipc --serve-args '--dtype bfloat16 --max-num-seqs 64
# --max-num-batched-tokens 64'"; figures to $OUT/serve-$LOG.{log,json}.
if [ -n "${SERVE_ARGS:-}" ]; then
  eval "set -- $SERVE_ARGS"
  shape_bench serve serve.py "${SERVE_TIMEOUT:-540}" "$@"
fi
exit $rc
