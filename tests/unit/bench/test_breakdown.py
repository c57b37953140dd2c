"""benchmarks/breakdown.py on synthetic torch profiler traces (host and device timelines)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import breakdown as bd  # benchmarks/breakdown.py
import pytest


def X(name, ts, dur, cat="user_annotation", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def attention_host(steps=4, period=1000.0, layers=2, send=50.0, wait=200.0):
    ev = []
    for i in range(steps):
        t = i * period
        ev.append(X(bd.FORWARD, t, period * 0.9))
        for j in range(layers):
            s = t + 100 + j * 300
            ev.append(X("afd.send", s, send))
            ev.append(X("afd.ffn_wait", s + send, wait))
            ev.append(X("aten::mm", s - 50, 40, cat="cpu_op"))  # not an AFD span
    return ev


def ffn_host(steps=4, period=1000.0, layers=2, recv=120.0, compute=150.0, send=30.0):
    ev = []
    for i in range(steps):
        t = i * period
        ev.append(X("afd.wait_step", t - 100, 100))
        ev.append(X("afd.ffn_step", t, layers * (recv + compute + send)))
        for j in range(layers):
            s = t + j * (recv + compute + send)
            ev.append(X("afd.recv", s, recv))
            ev.append(X("afd.ffn_compute", s + recv, compute))
            ev.append(X("afd.send", s + recv + compute, send))
    return ev


def test_host_attention_figures():
    f = bd.attention_figures(attention_host())
    assert f.source == "host" and f.steps == 3 and f.layers == 2
    assert f.per_step["step"] == pytest.approx(1000.0)
    assert f.per_step["send"] == pytest.approx(100.0)
    assert f.per_step["wait"] == pytest.approx(400.0)
    assert f.per_step["attention"] == pytest.approx(500.0)


def test_host_ffn_figures():
    f = bd.ffn_figures(ffn_host())
    assert f.source == "host" and f.steps == 3 and f.layers == 2
    assert f.per_step["compute"] == pytest.approx(300.0)
    assert f.per_step["recv"] == pytest.approx(240.0)
    assert f.per_step["send"] == pytest.approx(60.0)
    assert f.per_step["idle"] == pytest.approx(1000.0 - 600.0)


def test_combined_bound_and_gap():
    att = bd.attention_figures(attention_host())
    ffn = bd.ffn_figures(ffn_host())
    c = bd.combine(att, ffn)
    # max(attention 500, FFN 300) + transfer (100 out + 60 back)
    assert c["bound"] == pytest.approx(660.0)
    assert c["gap"] == pytest.approx(340.0)
    assert c["gap %"] == pytest.approx(100 * 340 / 660)


def test_dbo_hand_overs_are_not_waiting():
    """Two micro-batch threads: a thread's hand-over spans the other's work."""
    ev = []
    for i in range(3):
        t = i * 1000.0
        ev.append(X(bd.FORWARD, t, 900))
        # ubatch 0 sends, yields while ubatch 1 computes and sends, then waits
        ev += [X("afd.send", t + 100, 20, tid=1), X("afd.ubatch_yield", t + 120, 300, tid=1),
               X("afd.send", t + 400, 20, tid=2), X("afd.ffn_wait", t + 420, 50, tid=1),
               X("afd.ubatch_yield", t + 420, 200, tid=2), X("afd.ffn_wait", t + 620, 80, tid=2)]
    f = bd.attention_figures(ev)
    assert f.layers == 2
    assert f.per_step["wait"] == pytest.approx(130.0)
    assert f.per_step["send"] == pytest.approx(40.0)
    assert f.per_step["attention"] == pytest.approx(1000.0 - 170.0)


def device_trace(role: str, steps=4, period=1000.0):
    """Host spans plus a device timeline 30 us later: per step, compute 400, a copy 50,
    a signal kernel 10, a wait kernel 300; the rest of the period has no device work."""
    ev = []
    step = bd.FORWARD if role == "attention" else "afd.ffn_step"
    for i in range(steps):
        t = i * period
        ev.append(X(step, t, 800))
        ev.append(X(step, t + 30, 790, cat="gpu_user_annotation"))
        if role == "attention":
            ev.append(X("afd.send", t + 10, 5))
        else:
            ev.append(X("afd.ffn_graph_replay", t + 5, 5))
        d = t + 30
        ev += [X("void fused_moe_kernel<...>", d, 400, cat="kernel"),
               X("Memcpy PtoP (Device -> Device)", d + 400, 50, cat="gpu_memcpy"),
               X("_signal_kernel", d + 450, 10, cat="kernel"),
               X("_wait_kernel", d + 460, 300, cat="kernel")]
    return ev


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_device_timeline_wins_over_host_spans(role):
    f = (bd.attention_figures if role == "attention" else bd.ffn_figures)(device_trace(role))
    assert f.source == "device" and f.steps == 3
    assert f.layers == 1
    compute, waited = ("attention", "wait") if role == "attention" else ("compute", "recv")
    assert f.per_step["step"] == pytest.approx(1000.0)
    assert f.per_step[compute] == pytest.approx(400.0)
    assert f.per_step["send"] == pytest.approx(60.0)
    assert f.per_step[waited] == pytest.approx(300.0)
    assert f.per_step["device idle"] == pytest.approx(240.0)


def test_model_runner_v2_steps_come_from_the_control_kernels():
    """Runner V2 records no forward spans: each step's control kernel (at its first
    remote layer) starts a window; the same device figures as with the spans."""
    ev = [e for e in device_trace("attention") if e["name"] != bd.FORWARD]
    for i in range(4):
        ev.append(X("_control_kernel", i * 1000.0 + 20, 5, cat="kernel"))
    f = bd.attention_figures(ev)
    assert f.source == "device" and f.steps == 3 and f.layers == 1
    assert [round(a) for a, _ in f.windows] == [20, 1020, 2020]
    assert f.per_step["step"] == pytest.approx(1000.0)
    assert f.per_step["attention"] == pytest.approx(400.0)
    assert f.per_step["send"] == pytest.approx(65.0)  # signal + copy + the control kernel
    assert f.per_step["wait"] == pytest.approx(300.0)
    # Without a device timeline nothing delimits the steps: said, not guessed.
    host_only = [e for e in ev if e["cat"] == "user_annotation"]
    with pytest.raises(bd.TraceError, match="model runner V2 records no such spans"):
        bd.attention_figures(host_only)


def test_graph_replays_without_a_device_timeline_are_refused():
    ev = [X("afd.ffn_step", i * 100.0, 50) for i in range(3)]
    ev += [X("afd.ffn_graph_replay", i * 100.0 + 1, 40) for i in range(3)]
    with pytest.raises(bd.TraceError, match="CUDA graph replays"):
        bd.ffn_figures(ev)


def test_too_few_steps_say_what_is_missing():
    with pytest.raises(bd.TraceError, match="1 'gpu_model_runner: forward' span"):
        bd.attention_figures(attention_host(steps=1))
    # CPU DBO: the exchanges ran in micro-batch threads the profiler did not record
    forwards_only = [e for e in attention_host() if e["name"] == bd.FORWARD]
    with pytest.raises(bd.TraceError, match="micro-batch threads"):
        bd.attention_figures(forwards_only)
    with pytest.raises(bd.TraceError, match="0 'afd.ffn_step' span"):
        bd.ffn_figures(attention_host())


def test_ffn_figures_cover_the_attention_steps_only():
    """Shared time base: the FFN's idle tail after the run and a later step are outside
    the attention's profiled steps and do not count."""
    ev = ffn_host()
    ev += [X("afd.wait_step", 3700.0, 400000), X("afd.ffn_step", 404000.0, 600),
           X("afd.ffn_compute", 404100.0, 300)]
    own = bd.ffn_figures(ev)
    assert own.per_step["idle"] > 100000  # the tail spoils the FFN's own windows
    att = bd.attention_figures(attention_host())
    f = bd.ffn_figures(ev, att.windows)
    assert f.steps == 3 and f.layers == 2
    assert f.per_step["compute"] == pytest.approx(300.0)
    assert f.per_step["idle"] == pytest.approx(400.0)


def _write(path: Path, events, base_ns=None):
    data = {"traceEvents": events}
    if base_ns is not None:
        data["baseTimeNanoseconds"] = base_ns
    with gzip.open(path, "wt") as f:
        json.dump(data, f)


def test_time_bases_align_the_two_traces(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "f").mkdir()
    _write(tmp_path / "a" / "w.pt.trace.json.gz", attention_host(), base_ns=5_000_000)
    # the FFN trace's base is 2000 us later: its times are 2000 us smaller
    shifted = [dict(e, ts=e["ts"] - 2000.0) for e in ffn_host()]
    shifted += [X("afd.ffn_step", 50000.0, 600), X("afd.ffn_compute", 50100.0, 5000)]
    _write(tmp_path / "f" / "afd-ffn-rank0.pt.trace.json.gz", shifted, base_ns=7_000_000)
    r = bd.breakdown(tmp_path / "a", tmp_path / "f")
    assert r["same_windows"]
    assert r["ffn"].per_step["compute"] == pytest.approx(300.0)
    # no overlap at all (another host's clock): the FFN's own steps, said in the report
    _write(tmp_path / "f" / "afd-ffn-rank0.pt.trace.json.gz", ffn_host(), base_ns=9e15)
    r = bd.breakdown(tmp_path / "a", tmp_path / "f")
    assert not r["same_windows"] and r["ffn"].per_step["compute"] == pytest.approx(300.0)
    assert "do not share a time base" in bd.format_report(r)


def test_trace_files_found_and_read(tmp_path):
    att, ffn = tmp_path / "att", tmp_path / "ffn"
    att.mkdir()
    ffn.mkdir()
    with gzip.open(att / "host_worker.1.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": attention_host()}, f)
    (ffn / "other.pt.trace.json").write_text(json.dumps({"traceEvents": []}))
    (ffn / "afd-ffn-rank0.1.pt.trace.json").write_text(json.dumps({"traceEvents": ffn_host()}))
    assert bd.find_trace(ffn, "ffn").name.startswith("afd-ffn-rank0")
    r = bd.breakdown(att, ffn)
    assert r["combined"]["bound"] == pytest.approx(660.0)
    text = bd.format_report(r)
    assert "gap 340.0 us" in text and "attention (host timeline): 3 steps" in text
    assert json.loads(json.dumps(bd.as_json(r)))["ffn"]["us_per_step"]["compute"] == 300.0
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(bd.TraceError, match="no torch profiler trace"):
        bd.breakdown(att, empty)


def test_decode_waits_only_for_traces_not_written_yet(tmp_path):
    """benchmarks/decode.py: a trace not there yet is waited for (up to the timeout);
    one that is there but cannot give a breakdown fails at once, with the reason."""
    import time

    import decode

    t0 = time.monotonic()
    with pytest.raises(decode.BreakdownError, match="no torch profiler trace"):
        decode.run_breakdown(tmp_path, "afd_b8", timeout=1.5)
    assert 1.5 <= time.monotonic() - t0 < 10
    for role, ev in (("attention", attention_host(steps=1)), ("ffn", ffn_host())):
        d = tmp_path / f"afd_b8_trace_{role}"
        d.mkdir()
        name = "afd-ffn-rank0.pt.trace.json" if role == "ffn" else "attn.pt.trace.json"
        (d / name).write_text(json.dumps({"traceEvents": ev}))
    t0 = time.monotonic()
    with pytest.raises(decode.BreakdownError, match="1 'gpu_model_runner: forward' span"):
        decode.run_breakdown(tmp_path, "afd_b8", timeout=60)
    assert time.monotonic() - t0 < 5


def dbo_device_trace(steps=4, period=1000.0, link=True):
    """A micro-batched (DBO) step on the device, 30 us after its host forward: micro-batch
    0 computes, sends (copy + signal) and waits on its exchange stream while micro-batch 1
    computes, sends and waits; micro-batch 0's reply comes and it computes on while
    micro-batch 1 still waits. The profiler writes one device span of the forward per
    stream (four per step here), linked to the host span by its External id."""
    ev = []
    for i in range(steps):
        t, d, ext = i * period, i * period + 30, {"External id": 100 + i}
        ev.append(dict(X(bd.FORWARD, t, 900), args=dict(ext)))
        for stream, a, b in ((7, 0, 650), (8, 200, 500), (9, 215, 415), (10, 415, 600)):
            span = X(bd.FORWARD, d + a, b - a, cat="gpu_user_annotation", tid=stream)
            ev.append(dict(span, args=dict(ext)) if link else span)
        ev += [X("attention_ub0", d, 200, cat="kernel", tid=7),
               X("Memcpy DtoD", d + 200, 10, cat="gpu_memcpy", tid=8),
               X("_signal_kernel", d + 210, 5, cat="kernel", tid=8),
               X("_wait_kernel", d + 215, 285, cat="kernel", tid=8),
               X("attention_ub1", d + 215, 200, cat="kernel", tid=9),
               X("Memcpy DtoD", d + 415, 10, cat="gpu_memcpy", tid=10),
               X("_signal_kernel", d + 425, 5, cat="kernel", tid=10),
               X("_wait_kernel", d + 430, 170, cat="kernel", tid=10),
               X("lm_head_ub0", d + 500, 150, cat="kernel", tid=7)]  # fmt: skip
    return ev


@pytest.mark.parametrize("link", [True, False], ids=["external-id", "by-time"])
def test_dbo_steps_on_the_device_timeline(link):
    """One step per host forward however many streams its device work ran on (the H200
    DBO trace gave 895 'steps' of one exchange each), and each instant counted once: a
    micro-batch's wait kernel spinning while the other computes is compute."""
    f = bd.attention_figures(dbo_device_trace(link=link))
    assert f.source == "device" and f.steps == 3
    assert [round(a) for a, _ in f.windows] == [30, 1030, 2030]
    assert f.layers == 2  # one exchange per micro-batch
    assert f.per_step["step"] == pytest.approx(1000.0)
    assert f.per_step["attention"] == pytest.approx(550.0)  # 200 + 200 + 150
    assert f.per_step["send"] == pytest.approx(30.0)  # two copies + signals
    assert f.per_step["wait"] == pytest.approx(70.0)  # micro-batch 1 waits alone
    assert f.per_step["device idle"] == pytest.approx(350.0)


def test_dbo_ffn_steps_on_the_device_timeline():
    """The FFN rank's own steps (no attention windows) from its step spans, one per step
    although its device work ran on two streams."""
    ev = []
    for i in range(4):
        t = i * 1000.0
        ext = {"External id": 7 + i}
        ev.append(dict(X("afd.ffn_step", t, 800), args=ext))
        ev.append(X("afd.ffn_compute", t + 10, 100))
        for stream, a in ((3, 20), (4, 120)):
            ev.append(dict(X("afd.ffn_step", t + a, 100, cat="gpu_user_annotation", tid=stream),
                           args=ext))
        ev += [X("_wait_kernel", t + 20, 50, cat="kernel", tid=3),
               X("fused_moe_kernel", t + 70, 200, cat="kernel", tid=3),
               X("_wait_kernel", t + 120, 100, cat="kernel", tid=4)]  # fmt: skip
    f = bd.ffn_figures(ev)
    assert f.source == "device" and f.steps == 3 and f.layers == 2
    assert [round(a) for a, _ in f.windows] == [20, 1020, 2020]
    assert f.per_step["compute"] == pytest.approx(200.0)
    assert f.per_step["recv"] == pytest.approx(50.0)  # the second wait is under compute
    assert f.per_step["device idle"] == pytest.approx(750.0)


def test_the_nixl_device_paths_kernels_are_transfer_and_its_wait_waiting():
    """The nixl connector's kernels (copies into and out of its registered slots, the
    doorbell) are the transfer of a step, its wait on the reply flag is waiting; the
    FFN's own kernels stay compute."""
    kinds = {n: bd._classify({"cat": "kernel", "name": n})
             for n in ("_copy_to_slot_kernel", "_ring_kernel", "_copy_from_slot_kernel",
                       "_wait_kernel", "_control_kernel", "fused_moe_kernel")}  # fmt: skip
    assert kinds == {"_copy_to_slot_kernel": "transfer", "_ring_kernel": "transfer",
                     "_copy_from_slot_kernel": "transfer", "_wait_kernel": "wait",
                     "_control_kernel": "transfer", "fused_moe_kernel": "compute"}


def test_a_host_driven_ffn_loop_shows_its_host_spans_beside_the_device():
    """nixl's FFN rank: no wait kernel (the host polls for the inputs), each layer a host
    receive, block and send. Its layers are counted from the blocks, and the host's spans
    per step are reported beside the device figures: where the device's idle time went."""
    ev = []
    for i in range(4):
        t = i * 1000.0
        ev.append(X("afd.ffn_step", t, 900))
        for j in range(2):
            s = t + j * 450
            ev += [X("afd.recv", s, 100), X("afd.ffn_compute", s + 100, 50),
                   X("afd.send", s + 150, 250),
                   X("fused_moe_kernel", s + 120, 150, cat="kernel"),
                   X("Memcpy DtoD (Device -> Device)", s + 270, 20, cat="gpu_memcpy")]
    f = bd.ffn_figures(ev)
    assert f.source == "device" and f.steps == 3 and f.layers == 2
    assert f.per_step["compute"] == pytest.approx(300.0)
    assert f.per_step["send"] == pytest.approx(40.0)
    assert f.per_step["device idle"] == pytest.approx(660.0)
    assert f.host == pytest.approx({"step": 1000.0, "compute": 100.0, "recv": 200.0,
                                    "send": 500.0, "idle": 200.0})
    report = bd._fmt_role(f)
    assert any(line.split()[:2] == ["host", "send"] and line.split()[-1] == "250.00"
               for line in report), report


def test_ffn_graph_steps_report_no_host_spans():
    """A step that is one CUDA graph replay (cuda_ipc) has no host-driven layers."""
    f = bd.ffn_figures(device_trace("ffn"))
    assert f.source == "device" and f.host == {}
