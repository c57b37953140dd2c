"""AFD metrics (vllm.afd.metrics): snapshots, the collector and the Prometheus text."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import prometheus_client
import pytest
from overlay_import import child_env

from vllm.afd import failure, metrics


@pytest.fixture
def mdir(tmp_path, monkeypatch):
    """A private metrics directory (mode 0700, as the AFD runtime creates its own)."""
    path = tmp_path / "afd-metrics"
    path.mkdir(mode=0o700)
    path.chmod(0o700)
    monkeypatch.setenv("VLLM_AFD_METRICS_DIR", str(path))
    return path


def exposition(snapshots) -> dict[str, float]:
    """Prometheus text of the collector, parsed into {"name{labels}": value}."""

    class C:
        def collect(self):
            yield from metrics.collect_families(snapshots)

    reg = prometheus_client.CollectorRegistry()
    reg.register(C())
    text = prometheus_client.generate_latest(reg).decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_histogram_buckets():
    h = metrics._Histogram()
    for v in (0.00005, 0.0001, 0.003, 100.0):
        h.observe(v)
    assert h.count == 4 and h.sum == pytest.approx(100.00315)
    assert h.counts[0] == 2  # <= 0.0001 (bounds are inclusive)
    assert h.counts[metrics.BUCKETS.index(0.005)] == 1
    assert h.counts[-1] == 1  # +Inf


def test_record_adds_counters_and_observations_together():
    st = metrics.AFDStats()
    st.record({"steps": 1, "bytes_sent": 512}, {"step_ffn_wait_seconds": 0.003})
    st.record({"steps": 1, "bytes_sent": 512})
    snap = st.snapshot()
    assert snap["counters"]["steps"] == 2 and snap["counters"]["bytes_sent"] == 1024
    wait = snap["histograms"]["step_ffn_wait_seconds"]
    assert wait["count"] == 1 and wait["sum"] == pytest.approx(0.003)


def _torn_snapshots(count_step, seconds: float = 0.5) -> int:
    """Snapshots (taken from another thread while `count_step` runs in a loop) that show a
    step counted without its bytes, or the other way round."""
    import threading

    st = metrics.AFDStats()
    stop = threading.Event()

    def worker():
        while not stop.is_set():
            count_step(st)

    t = threading.Thread(target=worker)
    t.start()
    torn = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            c = st.snapshot()["counters"]
            torn += c["bytes_sent"] != 512 * c["steps"]
    finally:
        stop.set()
        t.join()
    return torn


def test_a_snapshot_never_sees_half_a_recorded_step():
    """The metrics writer thread snapshots while the hot path records: a step's counters go
    in under one lock (seen in CI: the FFN's snapshot counted a step without its bytes)."""
    assert _torn_snapshots(lambda st: st.record({"steps": 1, "bytes_sent": 512})) == 0

    def one_inc_each(st):  # what the AFD hot paths did before record()
        st.inc("steps")
        st.inc("bytes_sent", 512)

    # the check above can tell: with one inc() per counter snapshots do fall in between
    assert _torn_snapshots(one_inc_each) > 0


def test_attention_series(mdir):
    st = metrics.AFDStats()
    st.start("attention", 0, lambda: {"ffn_rank_0": True})
    try:
        st.inc("steps", 3)
        st.inc("layer_exchanges", 9)
        st.inc("bytes_sent", 1000)
        st.observe("step_transfer_seconds", 0.002)
        st.observe("step_ffn_wait_seconds", 0.02)
        st.inc("ffn_steps_served", 5)  # not an attention series: not exposed
        st.write()
        (snap,) = metrics.read_snapshots()
        assert snap["pid"] == os.getpid() and snap["role"] == "attention"
        got = exposition([snap])
    finally:
        st.close()
    lv = 'afd_rank="0",role="attention"'
    assert got[f"vllm:afd_steps_total{{{lv}}}"] == 3
    assert got[f"vllm:afd_layer_exchanges_total{{{lv}}}"] == 9
    assert got[f"vllm:afd_bytes_sent_total{{{lv}}}"] == 1000
    assert got[f"vllm:afd_handshake_failures_total{{{lv}}}"] == 0
    assert got[f"vllm:afd_step_ffn_wait_seconds_count{{{lv}}}"] == 1
    assert got[f"vllm:afd_step_ffn_wait_seconds_sum{{{lv}}}"] == pytest.approx(0.02)
    assert got['vllm:afd_step_ffn_wait_seconds_bucket{afd_rank="0",le="0.01",role="attention"}'] == 0
    assert got['vllm:afd_step_ffn_wait_seconds_bucket{afd_rank="0",le="0.025",role="attention"}'] == 1
    assert got['vllm:afd_step_ffn_wait_seconds_bucket{afd_rank="0",le="+Inf",role="attention"}'] == 1
    assert got['vllm:afd_peer_up{afd_rank="0",peer="ffn_rank_0",role="attention"}'] == 1
    assert not any("ffn_steps_served" in k for k in got)
    assert not any("ffn_step_compute" in k for k in got)


def test_ffn_series_per_layer(mdir):
    st = metrics.AFDStats()
    st.start("ffn", 1, lambda: {"attention_rank_2": True, "attention_rank_3": False})
    try:
        for layer, t in [(0, 0.001), (2, 0.003), (0, 0.002)]:
            st.layer(layer, t)
        st.inc("ffn_steps_served", 2)
        st.inc("ffn_idle_seconds", 1.5)
        st.observe("ffn_step_compute_seconds", 0.004)
        st.observe("step_ffn_wait_seconds", 1.0)  # attention-only: not exposed
        st.write()
        got = exposition(metrics.read_snapshots())
    finally:
        st.close()
    lv = 'afd_rank="1",role="ffn"'
    assert got[f"vllm:afd_ffn_steps_served_total{{{lv}}}"] == 2
    assert got[f"vllm:afd_ffn_idle_seconds_total{{{lv}}}"] == 1.5
    assert got['vllm:afd_ffn_layer_calls_total{afd_rank="1",layer="0",role="ffn"}'] == 2
    assert got['vllm:afd_ffn_layer_compute_seconds_total{afd_rank="1",layer="0",role="ffn"}'] == (
        pytest.approx(0.003)
    )
    assert got['vllm:afd_ffn_layer_calls_total{afd_rank="1",layer="2",role="ffn"}'] == 1
    assert got[f"vllm:afd_ffn_step_compute_seconds_count{{{lv}}}"] == 1
    assert got['vllm:afd_peer_up{afd_rank="1",peer="attention_rank_3",role="ffn"}'] == 0
    assert got['vllm:afd_peer_up{afd_rank="1",peer="attention_rank_2",role="ffn"}'] == 1
    assert not any("step_ffn_wait" in k for k in got)
    assert not any(k.startswith("vllm:afd_steps_total") for k in got)


def test_writer_thread_refreshes_and_close_removes_the_file(mdir):
    st = metrics.AFDStats()
    st.start("attention", 0, dict)
    path = mdir / f"attention-0-{os.getpid()}.json"
    try:
        assert json.loads(path.read_text())["counters"]["steps"] == 0
        st.inc("steps")
        deadline = time.monotonic() + 5
        while json.loads(path.read_text())["counters"]["steps"] != 1:
            assert time.monotonic() < deadline, "snapshot not refreshed"
            time.sleep(0.05)
    finally:
        st.close()
    assert not path.exists()


def test_a_write_in_flight_does_not_bring_back_the_file_close_removed(mdir):
    """The writer thread takes the snapshot's name, builds the snapshot, writes: a close()
    in between removed the file, and the write then put it back - a snapshot left behind
    by a process that is gone (write() also read the name twice: a close() between the two
    reads made it write a file named None)."""
    st = metrics.AFDStats()
    st.start("attention", 0, dict)
    path = mdir / f"attention-0-{os.getpid()}.json"
    assert path.exists()
    building, release = threading.Event(), threading.Event()
    real = st.snapshot

    def slow_snapshot():
        building.set()
        release.wait(10)
        return real()

    st.snapshot = slow_snapshot
    writer = threading.Thread(target=st.write, daemon=True)
    writer.start()
    assert building.wait(10)
    st.close()
    assert not path.exists()
    release.set()
    writer.join(10)
    assert not writer.is_alive()
    time.sleep(2 * metrics.WRITE_INTERVAL_S)  # the writer thread's own last round too
    assert sorted(os.listdir(mdir)) == [], "a write in flight brought the snapshot back"


def test_only_own_live_descendants_are_read(mdir):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        dead_pid = int(dead.stdout)
        for role, pid in [("attention", child.pid), ("ffn", dead_pid), ("ffn", 1)]:
            snap = {"pid": pid, "start": metrics.process_start(pid), "role": role,
                    "rank": 0, "time": time.time(), "counters": {"steps": 1}}
            (mdir / f"{role}-0-{pid}.json").write_text(json.dumps(snap))
        (mdir / "garbage.json").write_text("{not json")
        assert metrics.is_descendant(child.pid, os.getpid())
        assert not metrics.is_descendant(1, os.getpid())
        got = metrics.read_snapshots()
        assert [(s["role"], s["pid"]) for s in got] == [("attention", child.pid)]
        # from another ancestor's point of view (pid 1 is everyone's ancestor)
        assert {s["pid"] for s in metrics.read_snapshots(ancestor=1)} >= {child.pid, 1}
    finally:
        child.kill()
        child.wait()


def test_a_snapshot_of_a_reused_pid_is_not_read(mdir, monkeypatch):
    """A killed process leaves its snapshot; a new process (here: this one, a descendant of
    the reader) that gets the same pid must not inherit it - an attention rank's outage in
    such a file made a restarted server's /health answer 503 while it served."""
    me = os.getpid()
    start = metrics.process_start(me)
    assert isinstance(start, int) and start > 0
    stale = {"pid": me, "start": start - 1, "role": "attention", "rank": 0,
             "time": time.time(), "counters": {"steps": 1}, "outage_seconds": 5.4}
    (mdir / f"attention-0-{me}.json").write_text(json.dumps(stale))
    monkeypatch.setattr(metrics, "HEALTH_CACHE_S", 0.0)  # each call reads the files
    assert metrics.read_snapshots() == []
    assert metrics.health_problem() is None
    (mdir / f"attention-0-{me}.json").write_text(json.dumps({**stale, "start": start}))
    assert [s["pid"] for s in metrics.read_snapshots()] == [me]
    assert "attention rank 0 (5.4 s)" in metrics.health_problem()


def test_stale_files_are_pruned_on_write_and_health_reads_are_cached(mdir, monkeypatch):
    """10,000 stale files (snapshots of gone processes, which a SIGKILL leaves; failure
    records over an hour old, never removed before; a snapshot whose pid now names another
    process; temp files of writes that never finished): the next write prunes them, and
    /health's health_problem() reads the directory at most once per HEALTH_CACHE_S. Before:
    nothing was removed, and every /health call read every file on the server's event loop
    (151 ms with 10,000 files there), AFD server or not."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    old = time.time() - 2 * 3600  # records are read an hour back (failure.MAX_AGE_S)
    for i in range(5000):  # pids above pid_max: never a live process
        write_snapshot(mdir, f"attention-{i}-{pid_max + 1 + i}.json", pid=pid_max + 1 + i)
    for i in range(4990):
        write_record(mdir, f"ffn-{i}-{pid_max + 1 + i}.error", "lost AFD peer")
        os.utime(mdir / f"ffn-{i}-{pid_max + 1 + i}.error", (old, old))
    for i in range(9):
        (mdir / f".ffn-0-1.json.{i:016x}.tmp").write_text("{")
        os.utime(mdir / f".ffn-0-1.json.{i:016x}.tmp", (old, old))
    parent = os.getppid()  # live, but not the process that wrote this one
    write_snapshot(mdir, f"ffn-0-{parent}.json", pid=parent,
                   start=metrics.process_start(parent) - 1)  # fmt: skip
    assert len(os.listdir(mdir)) == 10_000
    write_record(mdir, "fresh.error", "lost AFD peer FFN rank 0")  # kept: recent
    reads = []
    real_read = metrics.read_private_files
    monkeypatch.setattr(metrics, "read_private_files",
                        lambda suffix: reads.append(suffix) or real_read(suffix))  # fmt: skip
    t0 = time.perf_counter()
    assert metrics.health_problem() is None
    first = time.perf_counter() - t0
    for _ in range(50):
        assert metrics.health_problem() is None
    assert len(reads) == 1, f"{len(reads)} reads of the directory for 51 /health calls"
    # this process's first write
    monkeypatch.setattr(metrics, "_next_prune", 0.0, raising=False)
    st = metrics.AFDStats()
    st.start("attention", 0, dict)
    try:
        left = sorted(os.listdir(mdir))
        assert left == [f"attention-0-{os.getpid()}.json", "fresh.error"], (len(left), left[:3])
        monkeypatch.setattr(metrics, "HEALTH_CACHE_S", 0.0)
        t0 = time.perf_counter()
        assert metrics.health_problem() is None
        pruned = time.perf_counter() - t0
    finally:
        st.close()
    print(f"health_problem(): {first * 1e3:.1f} ms with 10,000 stale files, "
          f"{pruned * 1e3:.2f} ms after the prune")


def test_newest_snapshot_per_role_and_rank(mdir):
    for t, steps in [(100.0, 1), (200.0, 7)]:
        snap = {"pid": os.getpid(), "start": metrics.process_start(os.getpid()),
                "role": "attention", "rank": 0, "time": t, "counters": {"steps": steps}}
        (mdir / f"attention-0-x{int(t)}.json").write_text(json.dumps(snap))
    (snap,) = metrics.read_snapshots()
    assert snap["counters"]["steps"] == 7


def test_register_prometheus_only_for_afd_servers():
    class Args:
        afd_config = None
        additional_config = None

    reg = prometheus_client.CollectorRegistry()
    metrics.register_prometheus(reg, Args())
    assert not any(isinstance(c, metrics.AFDCollector) for c in reg._collector_to_names)
    args = Args()
    args.afd_config = {"role": "ffn", "host": "127.0.0.1", "port": 29600}
    metrics.register_prometheus(reg, args)
    assert any(isinstance(c, metrics.AFDCollector) for c in reg._collector_to_names)


# ------------------------------------------------------------- failure records
def test_failure_record_reaches_this_servers_engine_dead_error(mdir):
    from vllm.v1.engine.exceptions import EngineDeadError

    assert failure.engine_dead_detail() == ""
    assert str(EngineDeadError()).endswith("for the root cause.")
    # a child process of this one (like a worker) records its failure, then exits
    code = ("import overlay_import; overlay_import.install(); from vllm.afd import failure; "
            "failure.record('attention', 0, 'lost AFD peer FFN rank 0 at 10.0.0.2:29600')")
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env())
    assert failure.failure_of_this_server() == "lost AFD peer FFN rank 0 at 10.0.0.2:29600"
    msg = str(EngineDeadError())
    assert msg.startswith("EngineCore encountered an issue.")
    assert msg.endswith(" AFD: lost AFD peer FFN rank 0 at 10.0.0.2:29600")


def test_failure_record_reaches_an_api_server_that_is_pid_1(mdir):
    """In a container the API server is often pid 1 (the entrypoint). Run here in a pid
    namespace of its own (``unshare --pid --fork --mount-proc``, as root), where the
    process is pid 1 and a child of it records a failure: the lookup finds it. Before, the
    recorded ancestry stopped short of pid 1, so engine_dead_detail() was '' and clients no
    longer learnt which peer was lost."""
    assert shutil.which("unshare"), "unshare (util-linux) is needed for this test"
    record = ("import overlay_import; overlay_import.install(); from vllm.afd import failure; "
              "failure.record('attention', 0, 'lost AFD peer FFN rank 0 at 10.0.0.2:29600')")
    api_server = (
        "import os, subprocess, sys\n"
        "import overlay_import; overlay_import.install()\n"
        "from vllm.afd import failure\n"
        "print('PID', os.getpid())\n"
        f"subprocess.run([sys.executable, '-c', {record!r}], check=True)\n"
        "print('DETAIL', repr(failure.engine_dead_detail()))\n"
    )
    out = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", api_server],
        env=child_env(), capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert out.returncode == 0, f"the pid-namespace run failed:\n{out.stdout}\n{out.stderr}"
    assert "PID 1\n" in out.stdout, out.stdout  # it really ran as pid 1
    assert "DETAIL ' AFD: lost AFD peer FFN rank 0 at 10.0.0.2:29600'" in out.stdout, out.stdout


def test_failure_records_of_other_servers_and_old_ones_are_ignored(mdir):
    now = time.time()
    records = {
        "other": {"time": now, "message": "not ours", "ancestry": [999999, 999998]},
        "old": {"time": now - 2 * failure.MAX_AGE_S, "message": "too old",
                "ancestry": [os.getpid()]},
        "older_ours": {"time": now - 10, "message": "first", "ancestry": [os.getpid()]},
        "newest_ours": {"time": now - 1, "message": "second", "ancestry": [12345, os.getpid()]},
    }
    for name, rec in records.items():
        (mdir / f"{name}.error").write_text(json.dumps({"role": "ffn", "rank": 0, **rec}))
    (mdir / "broken.error").write_text("{")
    assert failure.failure_of_this_server() == "second"
    assert failure.failure_of_this_server(pid=999998) == "not ours"
    assert failure.failure_of_this_server(pid=424242) is None


# ------------------------------------------------- the directory: who may write there
OTHER_UID = 65534  # nobody


@pytest.fixture
def default_dir(tmp_path, monkeypatch):
    """No VLLM_AFD_METRICS_DIR: the predictable default under a temp dir of this test."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.delenv("VLLM_AFD_METRICS_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return metrics.metrics_dir()


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    return path


def write_snapshot(directory, name: str, **fields) -> None:
    snap = {"pid": os.getpid(), "start": metrics.process_start(os.getpid()),
            "role": "attention", "rank": 0, "time": time.time(), "counters": {"steps": 1},
            **fields}
    (directory / name).write_text(json.dumps(snap))


def write_record(directory, name: str, message: str) -> None:
    rec = {"role": "ffn", "rank": 0, "message": message, "time": time.time(),
           "ancestry": [os.getpid()]}
    (directory / name).write_text(json.dumps(rec))


def owned_by_another_user(monkeypatch, *paths) -> None:
    """Make os.fstat/os.stat/os.lstat report OTHER_UID as the owner of ``paths`` (as if
    another user had created them: the test runs as one user)."""
    inodes = {os.lstat(p).st_ino for p in paths}
    for name in ("fstat", "stat", "lstat"):
        real = getattr(os, name)

        def fake(*args, _real=real, **kwargs):
            st = _real(*args, **kwargs)
            if st.st_ino not in inodes:
                return st
            fields = list(st[:10])
            fields[4] = OTHER_UID  # st_uid
            return os.stat_result(fields)

        monkeypatch.setattr(os, name, fake)


def test_default_dir_is_per_user_and_private(default_dir):
    assert default_dir.name == f"vllm-afd-{os.geteuid()}"
    failure.record("ffn", 0, "lost AFD peer attention rank 0")
    st = os.lstat(default_dir)
    assert st.st_uid == os.geteuid() and (st.st_mode & 0o777) == 0o700
    (path,) = default_dir.iterdir()
    assert path.name == f"ffn-0-{os.getpid()}.error"
    assert (path.stat().st_mode & 0o777) == 0o600
    assert failure.failure_of_this_server() == "lost AFD peer attention rank 0"


def test_a_symlink_planted_at_the_default_dir_is_not_followed(default_dir, tmp_path):
    """Another user creates the predictable directory as a symlink to a directory of the
    victim's: nothing is written there, nothing is read from there."""
    target = tmp_path / "victims_dir"
    target.mkdir(mode=0o700)
    write_record(target, "ffn-0-1.error", "forged")
    default_dir.symlink_to(target)
    failure.record("ffn", 0, "lost AFD peer")
    st = metrics.AFDStats()
    st.start("attention", 0, dict)
    st.close()
    assert [p.name for p in target.iterdir()] == ["ffn-0-1.error"]
    assert failure.failure_of_this_server() is None


def test_symlinks_in_the_dir_are_not_followed(mdir, victim):
    """Symlinks at the names a writer uses (its final and its former temp names) and at a
    snapshot's name: the victim file is neither overwritten nor read."""
    pid = os.getpid()
    for name in (f"ffn-0-{pid}.error", f"ffn-0-{pid}.error-tmp", f"attention-0-{pid}.json",
                 f"attention-0-{pid}.tmp"):
        (mdir / name).symlink_to(victim)
    failure.record("ffn", 0, "lost AFD peer attention rank 0")
    st = metrics.AFDStats()
    st.start("attention", 0, dict)
    try:
        st.write()
        assert victim.read_text() == "precious"
        assert failure.failure_of_this_server() == "lost AFD peer attention rank 0"
        assert [s["pid"] for s in metrics.read_snapshots()] == [pid]
    finally:
        st.close()
    # a symlink to a file holding a valid snapshot is not read either
    write_snapshot(victim.parent, "valid.json")
    (mdir / "linked-0-1.json").symlink_to(victim.parent / "valid.json")
    assert metrics.read_snapshots() == []
    assert victim.read_text() == "precious"


def test_files_of_another_user_are_ignored(mdir, monkeypatch):
    write_snapshot(mdir, "attention-0-1.json")
    write_record(mdir, "ffn-0-1.error", "forged by another user")
    owned_by_another_user(monkeypatch, mdir / "attention-0-1.json", mdir / "ffn-0-1.error")
    assert metrics.read_snapshots() == []
    assert failure.failure_of_this_server() is None
    write_record(mdir, "ffn-0-2.error", "ours")  # a file of this user still counts
    assert failure.failure_of_this_server() == "ours"


@pytest.mark.parametrize("how", ["group-writable", "world-readable", "another owner"])
def test_an_unsafe_dir_is_refused(mdir, monkeypatch, how):
    """Nothing is written to or read from a directory that another user can write to, read,
    or owns (VLLM_AFD_METRICS_DIR given or not): metrics and failure records are off."""
    write_snapshot(mdir, "attention-0-1.json")
    write_record(mdir, "ffn-0-1.error", "planted")
    if how == "another owner":
        owned_by_another_user(monkeypatch, mdir)
    else:
        mdir.chmod(0o770 if how == "group-writable" else 0o755)
    assert metrics.read_snapshots() == []
    assert failure.failure_of_this_server() is None
    failure.record("ffn", 0, "lost AFD peer")
    st = metrics.AFDStats()
    st.start("attention", 0, dict)
    st.write()
    st.close()
    assert sorted(p.name for p in mdir.iterdir()) == ["attention-0-1.json", "ffn-0-1.error"]
    with pytest.raises(metrics.UnsafeMetricsDirError, match="VLLM_AFD_METRICS_DIR"):
        metrics.check_metrics_dir()


def test_oversized_files_are_ignored(mdir):
    write_snapshot(mdir, "attention-0-1.json", pad="x" * (metrics.MAX_FILE_BYTES + 1))
    write_record(mdir, "ffn-0-1.error", "y" * (metrics.MAX_FILE_BYTES + 1))
    assert metrics.read_snapshots() == []
    assert failure.failure_of_this_server() is None


def test_failure_text_is_sanitised(mdir):
    """The recorded text reaches clients (EngineDeadError): no control characters (a
    terminal escape, a forged log line), and a bounded length."""
    failure.record("ffn", 0, "lost AFD peer\x1b[2J\r\nERROR forged line\x00" + "z" * 5000)
    msg = failure.failure_of_this_server()
    assert msg.startswith("lost AFD peer")
    assert len(msg) <= failure.MAX_MESSAGE_CHARS
    assert not any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in msg), repr(msg)
    # a record written some other way is cleaned when read, too
    write_record(mdir, "ffn-0-9.error", "bidi \u202eevil\u202c and\ttab" + "q" * 5000)
    msg = failure.failure_of_this_server()
    assert msg.startswith("bidi ") and "\u202e" not in msg and "\t" not in msg
    assert len(msg) <= failure.MAX_MESSAGE_CHARS


def test_snapshots_are_private_and_replaced_atomically(mdir):
    st = metrics.AFDStats()
    st.start("ffn", 0, dict)
    try:
        for _ in range(3):
            st.write()
        (path,) = mdir.iterdir()  # no temp file left beside it
        assert path.name == f"ffn-0-{os.getpid()}.json"
        assert (path.stat().st_mode & 0o777) == 0o600
    finally:
        st.close()
    assert list(mdir.iterdir()) == []
