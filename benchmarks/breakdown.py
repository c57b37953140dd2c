"""Per-layer breakdown of AFD decode steps from torch profiler traces of both roles.

    python benchmarks/breakdown.py --attention ATTN_TRACE_DIR --ffn FFN_TRACE_DIR

(``benchmarks/decode.py --breakdown`` records the traces and runs this.) Both directories
hold the Chrome traces that vLLM's torch profiler writes (``*.pt.trace.json[.gz]``; the FFN
rank's is named ``afd-ffn-rank<f>``), recorded over the same decode steps. The attention
server must run with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``: its steps are delimited by
vLLM's ``gpu_model_runner: forward`` spans, which vLLM records only then (model runner V1).
Model runner V2 records none: there the device timeline's step-control kernels of the
cuda_ipc connector (one per step) delimit the steps.

Per role, per step (then per remote layer: the step's figure over its layer count):

attention role
    ``step``: period of the attention's forward passes (start to next start, complete
    steps only: everything the engine does per step, scheduling and sampling included).
    ``send``: handing the layers' FFN inputs (and router logits) to the connector.
    ``wait``: blocked until the FFN outputs arrived (FFN compute + transfer back + any
    FFN-side delay). ``attention``: the rest of the step: attention layers, norms,
    embedding, LM head, sampling, scheduler, host overhead. With DBO the micro-batch
    hand-overs (time the other micro-batch runs) are not counted as waiting.
FFN role
    ``compute``: the FFN blocks; ``recv``: receiving the inputs (includes waiting for the
    attention to send them); ``send``: sending the outputs; ``idle``: between steps.

On a GPU the figures come from the device timeline when the trace has one (kernels and
copies, CUDA graphs included): the cuda_ipc connector's wait kernel is ``wait`` (``recv``
on the FFN rank), its copies and signal/control kernels are the transfer, other kernels
are compute, gaps with no device work are ``device idle`` (an FFN rank whose host drives
each layer, nixl's, also gets its host spans: where that idle time went); each instant
counts once, as compute if any stream computes, else transfer, else waiting (with DBO a
micro-batch's wait kernel spins while the other computes). A step's device work starts at
the earliest device span of its host step span (with DBO there is one per stream, many per
step). On the CPU (and for host-staged connectors) they come from the ``afd.*``
annotations of vllm/afd (``afd.send``, ``afd.ffn_wait``, ``afd.recv``, ``afd.ffn_compute``,
``afd.ffn_step``).

The bound of a step: ``max(attention, FFN compute) + transfer``, with
transfer = attention ``send`` + FFN ``send``; the gap is ``step - bound``. Without DBO a
step is serial (attention + wait), so the gap is about ``min(attention, FFN compute)``:
what overlap could win at most.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

FORWARD = "gpu_model_runner: forward"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# The connectors' kernels: cuda_ipc's (overlay/vllm/distributed/afd/ipc_kernels.py) and
# the nixl device path's (nixl_device.py: the copies into and out of the registered slots
# and the doorbell are transfer, its wait on the reply flag is waiting).
WAIT_KERNELS = ("_wait_kernel",)
CONTROL_KERNEL = "_control_kernel"
SIGNAL_KERNELS = ("_signal_kernel", CONTROL_KERNEL, "_ring_kernel", "_copy_to_slot_kernel",
                  "_copy_from_slot_kernel")


class TraceError(RuntimeError):
    pass


def find_trace(path: Path, role: str) -> Path:
    """The newest trace file under ``path`` (a file is taken as it is)."""
    if path.is_file():
        return path
    files = sorted(
        (p for p in path.rglob("*") if p.name.endswith((".pt.trace.json", ".pt.trace.json.gz"))),
        key=lambda p: p.stat().st_mtime,
    )
    if role == "ffn":
        ffn = [p for p in files if "afd-ffn" in p.name]
        files = ffn or files
    if not files:
        raise TraceError(f"no torch profiler trace (*.pt.trace.json[.gz]) under {path}")
    return files[-1]


def load_trace(path: Path) -> tuple[list[dict], float]:
    """Complete events ("ph": "X") of a trace and its time base in microseconds
    (``baseTimeNanoseconds``: traces of one host share it, so their times compare)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TraceError(f"cannot read trace {path}: {e}") from e
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"{path}: no traceEvents list")
    base = float(data.get("baseTimeNanoseconds", 0)) / 1e3 if isinstance(data, dict) else 0.0
    events = [
        e
        for e in events
        if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e
    ]
    return events, base


def _spans(events: list[dict], name: str) -> list[tuple[float, float]]:
    """The host spans (user annotations) named ``name``."""
    return sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("name") == name and e.get("cat") == "user_annotation"
    )


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _sum_in(spans: list[tuple[float, float]], window: tuple[float, float]) -> float:
    return sum(_overlap(s, window) for s in spans)


def _count_in(spans: list[tuple[float, float]], window: tuple[float, float]) -> int:
    return sum(1 for s in spans if window[0] <= s[0] < window[1])


def _union_in(spans: list[tuple[float, float]], window: tuple[float, float]) -> float:
    total, end = 0.0, window[0]
    for s, e in sorted(spans):
        s, e = max(s, end, window[0]), min(e, window[1])
        if e > s:
            total += e - s
            end = e
    return total


def _classify(e: dict) -> str:
    name = str(e.get("name", ""))
    if e.get("cat") == "kernel":
        if any(k in name for k in WAIT_KERNELS):
            return "wait"
        if any(k in name for k in SIGNAL_KERNELS):
            return "transfer"
        return "compute"
    return "transfer"  # copies and memsets


def _device(events: list[dict]) -> dict[str, list[tuple[float, float]]] | None:
    """Device intervals by category, None when the trace has no device timeline."""
    per_cat: dict[str, list[tuple[float, float]]] = {"compute": [], "transfer": [], "wait": []}
    found = False
    for e in events:
        if e.get("cat") in DEVICE_CATS:
            found = True
            per_cat[_classify(e)].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return per_cat if found else None


@dataclass
class RoleFigures:
    """Mean microseconds per step of each category, over ``steps`` complete steps."""

    role: str
    source: str  # "device" or "host"
    steps: int
    layers: float  # remote layer exchanges per step (x micro-batches with DBO)
    per_step: dict[str, float] = field(default_factory=dict)
    windows: list[tuple[float, float]] = field(default_factory=list)
    # A host-driven FFN loop (nixl) beside its device timeline: the host's spans per step
    # (receive, block, send and the rest), which say where the device's idle time went.
    host: dict[str, float] = field(default_factory=dict)


def _windows(starts: list[float]) -> list[tuple[float, float]]:
    return [(starts[i], starts[i + 1]) for i in range(len(starts) - 1)]


def _mean_in(spans: list[tuple[float, float]], wins: list[tuple[float, float]]) -> float:
    return sum(_sum_in(spans, w) for w in wins) / len(wins)


def _device_figures(per_cat, wins, names: tuple[str, str, str]) -> dict[str, float]:
    """Device time per step by what the device did, each instant counted once: compute
    (on any stream), else transfer, else waiting; idle when nothing ran. Without DBO the
    work is serial and these are the kernels' sums. With DBO the micro-batches run on
    streams of their own: one's wait kernel spins while the other computes, and that
    time is compute, not waiting."""
    compute, send, wait = names
    layers = per_cat["compute"]
    moving = layers + per_cat["transfer"]
    busy = moving + per_cat["wait"]

    def mean_union(spans):
        return sum(_union_in(spans, w) for w in wins) / len(wins)

    c, m, b = mean_union(layers), mean_union(moving), mean_union(busy)
    step = statistics.fmean(e - a for a, e in wins)
    return {"step": step, compute: c, send: m - c, wait: b - m, "device idle": step - b}


def _ext_id(e: dict):
    args = e.get("args")
    return args.get("External id") if isinstance(args, dict) else None


def _device_step_starts(events: list[dict], name: str) -> list[float]:
    """Where each step's device work starts, from the device spans of the host span
    ``name`` (one per step). The profiler writes one device span per host span and stream:
    with DBO a step's kernels run on several streams (the micro-batches' compute and
    exchange streams, and CUDA graph replays spread a graph's branches over more), so a
    step has many. Its start is the earliest of the device spans linked to its host span
    (the "External id" both carry), or, in a trace without the link, of those that start
    within its host span's period."""
    host = [e for e in events if e.get("name") == name and e.get("cat") == "user_annotation"]
    dev = [e for e in events if e.get("name") == name and e.get("cat") == "gpu_user_annotation"]
    ids = {_ext_id(e) for e in host} - {None}
    first: dict = {}
    for e in dev:
        key = _ext_id(e)
        if key in ids:
            first[key] = min(first.get(key, float("inf")), float(e["ts"]))
    if first:
        return sorted(first.values())
    starts = sorted(float(e["ts"]) for e in dev)
    hosts = sorted(float(e["ts"]) for e in host)
    if len(starts) <= len(hosts):
        return starts  # one device span per step
    for t in starts:
        i = bisect.bisect_right(hosts, t) - 1
        if i >= 0:
            first[i] = min(first.get(i, t), t)
    return sorted(first.values())


def _kernel_starts(events: list[dict], name: str) -> list[float]:
    return sorted(
        float(e["ts"]) for e in events if e.get("cat") == "kernel" and name in str(e.get("name"))
    )


def _attention_device(per_cat, dwins) -> RoleFigures:
    # One wait kernel per layer exchange (host spans of DBO micro-batch threads may be
    # missing, below).
    layers = sum(_count_in(per_cat["wait"], w) for w in dwins) / len(dwins)
    fig = _device_figures(per_cat, dwins, ("attention", "send", "wait"))
    return RoleFigures("attention", "device", len(dwins), layers, fig, dwins)


def attention_figures(events: list[dict]) -> RoleFigures:
    forwards = _spans(events, FORWARD)
    per_cat = _device(events)
    if len(forwards) < 2 and per_cat is not None:
        # Model runner V2 records no step spans: on the device timeline the cuda_ipc
        # connector's step-control kernel (one per step, at its first remote layer,
        # inside CUDA graphs too) delimits the steps instead.
        controls = _kernel_starts(events, CONTROL_KERNEL)
        if len(controls) >= 3:
            return _attention_device(per_cat, _windows(controls))
    if len(forwards) < 2:
        raise TraceError(
            f"attention trace: {len(forwards)} '{FORWARD}' span(s) and no steps from a "
            "device timeline; need at least 2 forward passes (run the attention server "
            "with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 and profile more decode steps; model "
            "runner V2 records no such spans: profile with CUDA activities and a connector "
            f"that launches '{CONTROL_KERNEL}' (cuda_ipc), or use model runner V1)"
        )
    wins = _windows([s for s, _ in forwards])
    if per_cat is not None:
        # A forward's launches run on the device a little later: windows are the device
        # extent of the forward spans where the trace has them.
        dwins = _windows(_device_step_starts(events, FORWARD)) or wins
        return _attention_device(per_cat, dwins)
    send = _spans(events, "afd.send")
    if not any(_count_in(send, w) for w in wins):
        raise TraceError(
            f"attention trace: {len(forwards)} forward passes but no 'afd.send' span in "
            "them. Is this an AFD attention server? With --enable-dbo the exchanges run in "
            "the micro-batch threads, which the torch profiler records only when told to "
            "record all threads (the AFD attention role asks for it where it can: the CPU "
            "worker's profiler)"
        )
    layers = sum(_count_in(send, w) for w in wins) / len(wins)
    fig = {
        "step": statistics.fmean(b - a for a, b in wins),
        "send": _mean_in(send, wins),
        "wait": _mean_in(_spans(events, "afd.ffn_wait"), wins),
    }
    fig["attention"] = fig["step"] - fig["send"] - fig["wait"]
    return RoleFigures("attention", "host", len(wins), layers, fig, wins)


def ffn_figures(
    events: list[dict], windows: list[tuple[float, float]] | None = None
) -> RoleFigures:
    """The FFN rank's figures over ``windows`` (the attention's steps, in this trace's
    time), or else over its own steps: from one served step's start to the next."""
    steps = _spans(events, "afd.ffn_step")
    if len(steps) < 2:
        raise TraceError(
            f"FFN trace: {len(steps)} 'afd.ffn_step' span(s); need at least 2 served steps "
            "(did the FFN server run with --profiler-config and serve profiled steps?)"
        )
    own = _windows([s for s, _ in steps])
    wins = windows or own
    served = sum(_count_in(steps, w) for w in wins)
    if served == 0:
        raise TraceError(
            "FFN trace: no served step lies within the attention's profiled steps: were "
            "both traces recorded over the same steps, on one host (one time base)?"
        )
    compute = _spans(events, "afd.ffn_compute")
    layers = sum(_count_in(compute, w) for w in wins) / served
    per_cat = _device(events)
    host = {
        "step": statistics.fmean(b - a for a, b in wins),
        "compute": _mean_in(compute, wins),
        "recv": _mean_in(_spans(events, "afd.recv"), wins),
        "send": _mean_in(_spans(events, "afd.send"), wins),
    }
    host["idle"] = host["step"] - host["compute"] - host["recv"] - host["send"]
    if per_cat is not None:
        dwins = windows or _windows(_device_step_starts(events, "afd.ffn_step")) or own
        if per_cat["wait"]:  # a device-side wait (cuda_ipc) a layer; else the host's blocks
            layers = sum(_count_in(per_cat["wait"], w) for w in dwins) / len(dwins)
        fig = _device_figures(per_cat, dwins, ("compute", "send", "recv"))
        # The host's spans matter where the host drives the layers (each block a host
        # call between a receive and a send); a step of graph replays has none.
        return RoleFigures("ffn", "device", len(dwins), layers, fig, dwins,
                           host if compute else {})  # fmt: skip
    if _spans(events, "afd.ffn_graph_replay") and not compute:
        raise TraceError(
            "FFN trace: the steps were CUDA graph replays and the trace has no device "
            "timeline; profile with CUDA activities, or turn the FFN graphs off "
            '(connector_extra_config {"ffn_cuda_graphs": false})'
        )
    return RoleFigures("ffn", "host", len(wins), layers, host, wins)


def combine(att: RoleFigures, ffn: RoleFigures) -> dict[str, float]:
    """Step time, the bound max(attention, FFN compute) + transfer, and the gap (us)."""
    a, f = att.per_step, ffn.per_step
    transfer = a["send"] + f["send"]
    bound = max(a["attention"], f["compute"]) + transfer
    return {
        "step": a["step"],
        "attention": a["attention"],
        "ffn compute": f["compute"],
        "transfer": transfer,
        "bound": bound,
        "gap": a["step"] - bound,
        "gap %": 100.0 * (a["step"] - bound) / bound if bound > 0 else float("nan"),
    }


def breakdown(attention: Path, ffn: Path) -> dict:
    """Both roles over the attention's profiled steps. Where the traces share a time
    base (one host) the FFN figures cover the same wall-clock windows; otherwise the
    FFN rank's own steps (idle then includes any time outside the attention's steps)."""
    att_ev, att_base = load_trace(find_trace(attention, "attention"))
    ffn_ev, ffn_base = load_trace(find_trace(ffn, "ffn"))
    att = attention_figures(att_ev)
    shift = att_base - ffn_base  # attention time + shift = FFN trace time
    wins = [(a + shift, b + shift) for a, b in att.windows]
    try:
        ff = ffn_figures(ffn_ev, wins)
        same = True
    except TraceError as e:
        if "no served step" not in str(e):
            raise
        ff = ffn_figures(ffn_ev)
        same = False
    return {"attention": att, "ffn": ff, "combined": combine(att, ff), "same_windows": same}


def _fmt_role(rf: RoleFigures) -> list[str]:
    per_layer = rf.layers or 1.0
    lines = [
        f"{rf.role} ({rf.source} timeline): {rf.steps} steps, {rf.layers:g} layer exchanges "
        "per step; us per step | per layer exchange"
    ]
    for k, v in rf.per_step.items():
        lines.append(f"  {k:12s} {v:10.1f} | {v / per_layer:9.2f}")
    if rf.host:
        lines.append("  the host's spans meanwhile (it drives each layer):")
        for k, v in rf.host.items():
            lines.append(f"    host {k:7s} {v:10.1f} | {v / per_layer:9.2f}")
    return lines


def format_report(r: dict) -> str:
    lines = [*_fmt_role(r["attention"]), *_fmt_role(r["ffn"])]
    if not r["same_windows"]:
        lines.append("  (the traces do not share a time base: FFN figures over its own steps)")
    c = r["combined"]
    lines.append(
        f"step {c['step']:.1f} us; bound max(attention {c['attention']:.1f}, FFN compute "
        f"{c['ffn compute']:.1f}) + transfer {c['transfer']:.1f} = {c['bound']:.1f} us; "
        f"gap {c['gap']:.1f} us ({c['gap %']:.1f}% over the bound)"
    )
    return "\n".join(lines)


def as_json(r: dict) -> dict:
    out = {}
    for k in ("attention", "ffn"):
        rf = r[k]
        out[k] = {
            "source": rf.source,
            "steps": rf.steps,
            "layers_per_step": rf.layers,
            "us_per_step": rf.per_step,
        }
        if rf.host:
            out[k]["host_us_per_step"] = rf.host
    out["combined_us"] = r["combined"]
    out["same_windows"] = r["same_windows"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", required=True, type=Path, help="attention trace dir or file")
    p.add_argument("--ffn", required=True, type=Path, help="FFN trace dir or file")
    p.add_argument("--json", type=Path, help="write the figures here")
    a = p.parse_args()
    try:
        r = breakdown(a.attention, a.ffn)
    except TraceError as e:
        print(f"breakdown: {e}", file=sys.stderr)
        return 2
    print(format_report(r))
    if a.json:
        a.json.write_text(json.dumps(as_json(r), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
