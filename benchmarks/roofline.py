"""The roofline beside the benchmarks' figures (benchmarks/decode.py and serve.py).

A decode step must at least move its bytes through the card's memory and do its FLOPs on
its matrix units: ``vllm.afd.plan.step_bound`` counts both for a benchmark configuration
(the weights each process reads, the experts its tokens touch, the KV cache) and divides
by the card's specification. The benchmarks print that bound beside every measured
figure and the figure as a fraction of it. The card comes from a small table
(``vllm.afd.plan.CARDS``: H100 SXM 3.35 TB/s, H200 4.8 TB/s, ...), chosen by the device's
name, by ``--card``, or given by ``--hbm-tbs`` (and ``--tflops``) for another device.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
from dataclasses import replace

DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "half": 2.0, "float32": 4.0, "float": 4.0,
               "auto": None}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--card", default="auto",
                   help="the roofline's card: one of vllm.afd.plan.CARDS (h100, h200, h800, "
                   "h20, a100) or auto (the device's name)")
    p.add_argument("--hbm-tbs", type=float, default=None,
                   help="the roofline's memory bandwidth, TB/s (overrides the card's; for a "
                   "device the table lacks, e.g. the CPU)")
    p.add_argument("--tflops", type=float, default=None,
                   help="the roofline's bf16 matrix peak, TFLOP/s (fp8: twice)")


def check_arguments(p: argparse.ArgumentParser, a) -> None:
    if (a.hbm_tbs is not None and a.hbm_tbs <= 0) or (a.tflops is not None and a.tflops <= 0):
        p.error("--hbm-tbs and --tflops must be positive")
    from vllm.afd.plan import CARDS

    if a.card != "auto" and a.card not in CARDS:
        p.error(f"--card {a.card}: one of auto, {', '.join(sorted(CARDS))}")


def model_for(model_dir: str, dtype: str | None):
    """The roofline's model of a config directory, its weights and KV cache in ``dtype``
    (None: the config's); (None, reason) where it cannot be read."""
    from vllm.afd import plan

    nbytes = DTYPE_BYTES.get(dtype or "auto", "?")
    if nbytes == "?":
        return None, f"no roofline for dtype {dtype}"
    try:
        return plan.load_model(model_dir, weight_bytes=nbytes, kv_bytes=nbytes), ""
    except (ValueError, OSError, json.JSONDecodeError) as e:
        return None, f"no roofline: {e}"


def card_for(card: str, hbm_tbs: float | None, tflops: float | None, devices: list[str]):
    """The roofline's card: ``card``, else the devices' (one name) from the table;
    ``hbm_tbs`` and ``tflops`` override its figures or stand for a device the table lacks
    (without ``tflops`` its bound is the bytes alone). (None, reason) without either."""
    from vllm.afd import plan

    devices = sorted(set(devices))
    key = card if card != "auto" else (plan.card_for_device(devices[0])
                                       if len(devices) == 1 else None)
    found = plan.CARDS.get(key) if key else None
    if found is None and hbm_tbs is None:
        return None, (f"no roofline: no figures for device {', '.join(devices) or '?'} "
                      "(--card, or --hbm-tbs [--tflops])")
    if found is None:
        found = plan.Card(devices[0] if devices else "device", hbm_tbs, math.inf, math.inf,
                          0.0, 0.0, 0.0)
    if hbm_tbs is not None:
        found = replace(found, hbm_tbs=hbm_tbs)
    if tflops is not None:
        found = replace(found, bf16_tflops=tflops, fp8_tflops=2 * tflops)
    return found, ""


def gpu_name(gpu: str) -> str | None:
    """The name of CUDA device ``gpu`` by nvidia-smi (None without it)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    r = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader", "-i", gpu],
                       capture_output=True, text=True, timeout=30)
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def routing_of(routing: str) -> str:
    """The roofline's routing for a benchmark's: ``balanced`` as run, the checkpoint's
    router as uniform (a trained router's batch is close to it; dummy weights may touch
    fewer experts: docs/benchmarks.md)."""
    return "balanced" if routing == "balanced" else "uniform"


def bound_mode(base: str, schedule: str) -> str | None:
    """The ``vllm.afd.plan.step_bound`` mode of a benchmark mode (its base and FFN schedule,
    serve_util.split_mode): an AFD mode's bound is its schedule's (pingpong: each rank's
    step served apart, the experts read once a rank); ``auto`` mixes joined and interleaved
    rounds and has no one bound (None)."""
    if schedule == "auto":
        return None
    if base.startswith("afd"):
        return "afd_pingpong" if schedule == "pingpong" else "afd"
    return base


def describe(card, model, context: float) -> str:
    return (f"roofline: {card.name}, {card.hbm_tbs:g} TB/s, {card.bf16_tflops:g} TFLOP/s bf16; "
            f"{model.name}: {model.layers} layers, {model.experts} experts top-{model.top_k}, "
            f"{model.weight_bytes:g} B a weight; mean context {context:g} tokens "
            "(vllm.afd.plan.step_bound)")
