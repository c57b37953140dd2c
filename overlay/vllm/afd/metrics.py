# SPDX-License-Identifier: Apache-2.0
"""AFD metrics: recorded where the work happens, served by the API server.

The AFD runtime runs in the engine-core / worker process, while ``/metrics``
is served by the API-server process. Each AFD process keeps its figures in
:data:`STATS` and a daemon thread writes them as one small JSON snapshot per
process (``<role>-<rank>-<pid>.json`` in :func:`metrics_dir`) every
:data:`WRITE_INTERVAL_S`. The API server's collector
(:func:`register_prometheus`, hooked into vLLM's ``/metrics`` router) turns
the snapshots of its own descendant processes into Prometheus series;
snapshots of other or dead processes are ignored. Nothing is read from the
network here.

The directory (``$VLLM_AFD_METRICS_DIR``, default ``<tmp>/vllm-afd-<uid>``)
also holds the failure records of :mod:`vllm.afd.failure`, whose text reaches
clients. A write prunes it (at most every :data:`PRUNE_INTERVAL_S` per process): the
snapshots of processes that are gone (a SIGKILL leaves them), files older than
:data:`STALE_FILE_S`, failure records beyond the newest :data:`MAX_RECORDS`, and temp
files of a write that never finished. It must be private: a real directory (not a symlink), owned by this
user, no permission bits for group or others; it is created so (mode 0700).
Any other is refused (:class:`UnsafeMetricsDirError`, logged once): the AFD
metrics and failure records are then off and serving goes on. Files are
written under a random temp name (``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600)
and renamed into place; readers open them with ``O_NOFOLLOW`` and read only
regular files of this user up to :data:`MAX_FILE_BYTES`.

Series (all labelled ``role`` and ``afd_rank``):

attention role
    ``vllm:afd_steps_total``, ``vllm:afd_layer_exchanges_total``,
    ``vllm:afd_step_transfer_seconds`` (histogram: per step, time spent
    handing the step's activations and control messages to the connector),
    ``vllm:afd_step_ffn_wait_seconds`` (histogram: per step, time blocked
    until the FFN outputs arrived), ``vllm:afd_bytes_sent_total``,
    ``vllm:afd_bytes_received_total``, ``vllm:afd_peer_up{peer}``,
    ``vllm:afd_handshake_failures_total``, ``vllm:afd_rejoins_total`` (a lost FFN
    rank reached again and the step re-run), ``vllm:afd_outage_seconds_total``
    (seconds without the FFN rank, over the outages that ended in a rejoin),
    ``vllm:afd_home_refusals_total`` (served by another FFN replica, ffn_failover: times
    its own FFN rank refused it at the re-handshake - another checkpoint, revision,
    topology or secret came back there),
    ``vllm:afd_peer_outage_seconds`` (gauge: seconds since the FFN rank was lost,
    0 while it is connected).
FFN role
    ``vllm:afd_ffn_steps_served_total``, ``vllm:afd_ffn_batched_steps_total``,
    ``vllm:afd_ffn_ubatched_steps_total``, ``vllm:afd_ffn_pingpong_steps_total``,
    ``vllm:afd_ffn_straggler_splits_total``,
    ``vllm:afd_ffn_graph_replays_total``, ``vllm:afd_ffn_layer_graph_replays_total``,
    ``vllm:afd_ffn_graph_captures_total``, ``vllm:afd_ffn_graph_capture_seconds_total``,
    ``vllm:afd_ffn_step_compute_seconds`` (histogram),
    ``vllm:afd_ffn_step_transfer_seconds`` (histogram),
    ``vllm:afd_ffn_layer_compute_seconds_total{layer}``,
    ``vllm:afd_ffn_layer_calls_total{layer}``,
    ``vllm:afd_ffn_idle_seconds_total``, ``vllm:afd_bytes_sent_total``,
    ``vllm:afd_bytes_received_total``, ``vllm:afd_peer_up{peer}``,
    ``vllm:afd_handshake_failures_total``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing import util as mp_util
from pathlib import Path

from vllm.afd import roles
from vllm.logger import init_logger

logger = init_logger(__name__)

WRITE_INTERVAL_S = 0.5
# Seconds; per-step AFD times range from tens of microseconds (CPU, tiny
# model) to tens of milliseconds (large prefill over a network).
BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

HISTOGRAMS = {
    "step_transfer_seconds": "Per AFD step: time spent sending activations and control "
    "messages to the peer.",
    "step_ffn_wait_seconds": "Per AFD step (attention role): time blocked waiting for the "
    "FFN outputs (FFN compute + transfer back).",
    "ffn_step_compute_seconds": "Per AFD step (FFN role): FFN compute time over all layers.",
    "ffn_step_transfer_seconds": "Per AFD step (FFN role): time receiving inputs and sending "
    "outputs.",
}
COUNTERS = {
    "steps": "AFD steps (forward passes) exchanged with the FFN role.",
    "layer_exchanges": "AFD layer exchanges (one per remote FFN layer per step).",
    "bytes_sent": "Bytes of activations sent to AFD peers.",
    "bytes_received": "Bytes of activations received from AFD peers.",
    "handshake_failures": "AFD handshakes that failed or connections dropped before one.",
    "ffn_steps_served": "AFD steps served by this FFN rank.",
    "ffn_batched_steps": "AFD steps that served several attention ranks in one pass.",
    "ffn_idle_seconds": "Seconds the FFN serve loop waited with no step to run.",
    "ffn_graph_replays": "AFD steps the FFN rank served by replaying one of its CUDA graphs.",
    "ffn_layer_graph_replays": "FFN layers served by replaying a CUDA graph of the layer's "
    "block (data planes the host drives: gloo, nixl).",
    "ffn_graph_captures": "CUDA graphs the FFN rank captured (each stalls the ranks it serves).",
    "ffn_graph_capture_seconds": "Seconds the FFN rank spent capturing CUDA graphs.",
    "ffn_ubatched_steps": "AFD steps served as micro-batches (DBO on the attention rank).",
    "ffn_pingpong_steps": "AFD rounds that served several attention ranks' steps interleaved "
    "layer by layer (connector_extra_config.ffn_schedule pingpong, or auto).",
    "ffn_straggler_splits": "AFD passes that went on without ranks whose layer input was "
    "late (those continued on their own, or ended at their own deadline).",
    "rejoins": "Times this attention rank reached its lost FFN rank again and re-ran the step.",
    "outage_seconds": "Seconds this attention rank was without its FFN rank, over the outages "
    "that ended in a rejoin.",
    "home_refusals": "Times this attention rank, served by another FFN replica (ffn_failover), "
    "was refused by its own FFN rank at the re-handshake (another deployment there).",
}
ATTENTION_COUNTERS = ("steps", "layer_exchanges", "bytes_sent", "bytes_received",
                      "handshake_failures", "rejoins", "outage_seconds", "home_refusals")
FFN_COUNTERS = ("ffn_steps_served", "ffn_batched_steps", "ffn_idle_seconds", "bytes_sent",
                "bytes_received", "handshake_failures", "ffn_graph_replays",
                "ffn_layer_graph_replays", "ffn_graph_captures", "ffn_graph_capture_seconds",
                "ffn_ubatched_steps", "ffn_pingpong_steps", "ffn_straggler_splits")
ATTENTION_HISTOGRAMS = ("step_transfer_seconds", "step_ffn_wait_seconds")
FFN_HISTOGRAMS = ("ffn_step_compute_seconds", "ffn_step_transfer_seconds")
LAYER_COUNTERS = {
    "ffn_layer_compute_seconds": "FFN compute seconds per layer.",
    "ffn_layer_calls": "FFN calls per layer.",
}


# --------------------------------------------------------- the private directory
METRICS_DIR_ENV = "VLLM_AFD_METRICS_DIR"
MAX_FILE_BYTES = 1 << 20  # a snapshot of a 100-layer FFN rank is ~20 KiB
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_reported: set[str] = set()


class UnsafeMetricsDirError(OSError):
    """The metrics directory is not private to this user."""


def metrics_dir() -> Path:
    """``$VLLM_AFD_METRICS_DIR``, default ``<tmp>/vllm-afd-<uid>`` (one per user)."""
    return Path(
        os.environ.get(METRICS_DIR_ENV)
        or os.path.join(tempfile.gettempdir(), f"vllm-afd-{os.geteuid()}")
    )


def _refuse(path: Path, why: str) -> UnsafeMetricsDirError:
    return UnsafeMetricsDirError(
        f"AFD: the metrics directory {path} {why}; it also holds the failure text that "
        f"clients see, so it must be private. Remove it, or set {METRICS_DIR_ENV} to a "
        "directory of this user with mode 0700 (it is created so when missing)"
    )


def _check_dir_fd(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"is owned by uid {st.st_uid}, not by this user (uid "
                            f"{os.geteuid()})")  # fmt: skip
    if st.st_mode & 0o077:
        raise _refuse(path, f"has mode {stat.S_IMODE(st.st_mode):04o}: other users can "
                            "read or write it")  # fmt: skip


def open_metrics_dir(create: bool) -> int | None:
    """A descriptor of the checked metrics directory (the caller closes it); with
    ``create`` it is made (mode 0700) when missing, else None then. Raises
    :class:`UnsafeMetricsDirError` for a symlink, a non-directory, another owner or
    group/other permission bits."""
    path = metrics_dir()
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        fd = os.open(path, _OPEN_DIR)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as e:  # ELOOP: a symlink; ENOTDIR: not a directory
        raise _refuse(path, f"is not a plain directory ({e.strerror})") from e
    try:
        _check_dir_fd(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_metrics_dir() -> Path:
    """The metrics directory, created when missing; raises UnsafeMetricsDirError."""
    os.close(open_metrics_dir(create=True))
    return metrics_dir()


@contextlib.contextmanager
def _metrics_dir_fd(create: bool):
    """The directory's descriptor, or None when it is missing or unusable (an unsafe
    one is logged once per process and reason)."""
    try:
        fd = open_metrics_dir(create)
    except OSError as e:
        if str(e) not in _reported:
            _reported.add(str(e))
            logger.error("%s; AFD metrics and failure records are off", e)
        fd = None
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def write_private_file(name: str, data: bytes) -> bool:
    """Write ``name`` in the metrics directory atomically: a new temp file of a random
    name (never a file or link that is there), then a rename over ``name`` (which
    replaces a link there, not its target). False when it could not be written. Prunes
    the directory when it is due (:func:`prune_private_files`)."""
    with _metrics_dir_fd(create=True) as dfd:
        if dfd is None:
            return False
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, _OPEN_NEW, 0o600, dir_fd=dfd)
            with open(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            return False
        _prune_when_due(dfd)
    return True


# ------------------------------------------------------------------ pruning
STALE_FILE_S = 3600.0  # vllm.afd.failure reads records an hour back; a snapshot is 0.5 s old
STALE_TMP_S = 60.0  # the temp file of a write that never reached its rename
MAX_RECORDS = 256  # failure records kept, newest first (a crash loop writes one a crash)
PRUNE_INTERVAL_S = 60.0  # per process
_next_prune = 0.0
_prune_lock = threading.Lock()


def _prune_when_due(dfd: int) -> None:
    global _next_prune
    now = time.monotonic()
    with _prune_lock:
        if now < _next_prune:
            return
        _next_prune = now + PRUNE_INTERVAL_S
    try:
        _prune(dfd, time.time())
    except OSError:  # best effort: never fail the write for it
        pass


def prune_private_files() -> int:
    """Remove what is stale in the metrics directory now; how many files went."""
    with _metrics_dir_fd(create=False) as dfd:
        return 0 if dfd is None else _prune(dfd, time.time())


def _prune(dfd: int, now: float) -> int:
    """Remove this user's regular files that are stale: snapshots (``*.json``) of a
    process that is gone or older than STALE_FILE_S, failure records (``*.error``)
    older than that or beyond the newest MAX_RECORDS, temp files (``.*.tmp``) older
    than STALE_TMP_S. Anything else is left alone."""
    removed = 0
    records: list[tuple[float, str]] = []
    procs = process_start(os.getpid()) is not None  # /proc readable: pids can be checked
    for name in os.listdir(dfd):
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            continue
        age = now - st.st_mtime
        if name.startswith("."):
            stale = name.endswith(".tmp") and age > STALE_TMP_S
        elif name.endswith(".error"):
            stale = age > STALE_FILE_S
            if not stale:
                records.append((st.st_mtime, name))
        elif name.endswith(".json"):
            stale = age > STALE_FILE_S or (procs and _writer_gone(dfd, name))
        else:
            stale = False
        if stale:
            removed += _unlink(dfd, name)
    records.sort(reverse=True)
    for _, name in records[MAX_RECORDS:]:
        removed += _unlink(dfd, name)
    return removed


def _writer_gone(dfd: int, name: str) -> bool:
    """The process that wrote snapshot ``<role>-<rank>-<pid>.json`` is gone: no such
    pid, or the pid names a later process (another start time)."""
    try:
        pid = int(name[: -len(".json")].rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    start = process_start(pid)
    if start is None:
        return True
    try:
        return json.loads(_read_own_file(dfd, name) or b"")["start"] != start
    except (ValueError, KeyError, TypeError):
        return False


def _unlink(dfd: int, name: str) -> int:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        return 0
    return 1


def remove_private_file(name: str) -> None:
    with _metrics_dir_fd(create=False) as dfd, contextlib.suppress(OSError):
        if dfd is not None:
            os.unlink(name, dir_fd=dfd)


def read_private_files(suffix: str) -> list[tuple[str, bytes]]:
    """(name, content) of the files ``*<suffix>`` in the metrics directory that are
    regular files of this user of at most MAX_FILE_BYTES (links are not followed)."""
    out = []
    with _metrics_dir_fd(create=False) as dfd:
        if dfd is None:
            return []
        for name in sorted(os.listdir(dfd)):
            if name.endswith(suffix) and not name.startswith("."):
                data = _read_own_file(dfd, name)
                if data is not None:
                    out.append((name, data))
    return out


def _read_own_file(dfd: int, name: str) -> bytes | None:
    try:
        fd = os.open(name, _OPEN_READ, dir_fd=dfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        data = os.read(fd, MAX_FILE_BYTES + 1)
        return data if len(data) <= MAX_FILE_BYTES else None
    except OSError:
        return None
    finally:
        os.close(fd)


class _Histogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        i = 0
        while i < len(BUCKETS) and v > BUCKETS[i]:
            i += 1
        self.counts[i] += 1
        self.sum += v
        self.count += 1


class AFDStats:
    """Process-local AFD figures (cheap to update from the hot path)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.role: str | None = None
        self.rank = 0
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.layers: dict[str, dict[int, float]] = {k: {} for k in LAYER_COUNTERS}
        self.histograms = {k: _Histogram() for k in HISTOGRAMS}
        self.peers: Callable[[], dict[str, bool]] | None = None
        # Attention role: seconds since its FFN rank was lost (0 while connected).
        self.outage: Callable[[], float] | None = None
        self._writer: threading.Thread | None = None
        self._stop = threading.Event()
        self._name: str | None = None
        # A write and close() one after the other: a write in flight when close() removes
        # the file would bring it back (a snapshot left by a process that is gone).
        self._file_lock = threading.Lock()

    # -- recording ---------------------------------------------------------
    def inc(self, name: str, n: float = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self.histograms[name].observe(seconds)

    def record(self, counters: dict[str, float],
               observations: dict[str, float] | None = None) -> None:
        """Add to several counters and histograms at once: a snapshot sees all of one
        step's figures or none (with one inc() each, the writer thread could snapshot a
        step counted but its bytes not yet)."""
        with self._lock:
            for name, n in counters.items():
                self.counters[name] += n
            for name, seconds in (observations or {}).items():
                self.histograms[name].observe(seconds)

    def layer(self, layer_idx: int, seconds: float) -> None:
        with self._lock:
            t = self.layers["ffn_layer_compute_seconds"]
            c = self.layers["ffn_layer_calls"]
            t[layer_idx] = t.get(layer_idx, 0.0) + seconds
            c[layer_idx] = c.get(layer_idx, 0) + 1

    # -- snapshots -----------------------------------------------------------
    def snapshot(self) -> dict:
        peers = {}
        if self.peers is not None:
            with contextlib.suppress(Exception):
                peers = {k: bool(v) for k, v in self.peers().items()}
        outage = None
        if self.outage is not None:
            with contextlib.suppress(Exception):
                outage = float(self.outage())
        with self._lock:
            return {
                "pid": os.getpid(),
                "start": process_start(os.getpid()),
                "role": self.role,
                "rank": self.rank,
                "time": time.time(),
                "counters": dict(self.counters),
                "layers": {k: {str(i): v for i, v in d.items()} for k, d in self.layers.items()},
                "histograms": {
                    k: {"counts": list(h.counts), "sum": h.sum, "count": h.count}
                    for k, h in self.histograms.items()
                },
                "peers": peers,
                "outage_seconds": outage,
            }

    def start(self, role: str, rank: int, peers: Callable[[], dict[str, bool]]) -> None:
        """Begin writing snapshots for this process (idempotent)."""
        self.role, self.rank, self.peers = role, rank, peers
        if self._writer is not None:
            return
        self._name = f"{role}-{rank}-{os.getpid()}.json"
        if not self.write():
            self._name = None
            return  # metrics are best effort (an unsafe directory is logged); serving goes on
        self._writer = threading.Thread(target=self._loop, name="afd-metrics", daemon=True)
        self._writer.start()
        # At the process's exit, in a forked multiprocessing child too (vLLM's engine
        # core on a GPU host: no atexit hook runs there), after the roles' own closing.
        mp_util.Finalize(None, self.close, exitpriority=roles.EXIT_METRICS_REMOVAL)

    def write(self) -> bool:
        name = self._name
        if name is None:
            return False
        data = json.dumps(self.snapshot()).encode()
        with self._file_lock:
            if self._name != name:  # closed meanwhile
                return False
            return write_private_file(name, data)

    def _loop(self) -> None:
        while not self._stop.wait(WRITE_INTERVAL_S):
            self.write()

    def close(self) -> None:
        self._stop.set()
        with self._file_lock:
            name, self._name = self._name, None
            if name is not None:
                remove_private_file(name)


STATS = AFDStats()


# ---------------------------------------------------------------- collector
def _stat_field(pid: int, field: int) -> int | None:
    """Field ``field`` (1-based, as proc(5) numbers them, 4 or more) of /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ..." - comm may hold spaces and parentheses
    try:
        return int(stat.rsplit(")", 1)[1].split()[field - 3])
    except (IndexError, ValueError):
        return None


def parent_pid(pid: int) -> int | None:
    return _stat_field(pid, 4)


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot): with the pid it names one
    process, since the kernel reuses pids."""
    return _stat_field(pid, 22)


def is_descendant(pid: int, ancestor: int) -> bool:
    for _ in range(64):
        if pid == ancestor:
            return True
        if pid is None or pid <= 1:
            return False
        pid = parent_pid(pid)
    return False


def read_snapshots(ancestor: int | None = None) -> list[dict]:
    """Snapshots of live AFD processes that are ``ancestor`` (default: this
    process) or its descendants; the newest per (role, rank). A snapshot counts only
    while the process that wrote it runs: the same pid with the same start time (a
    killed process leaves its file, and its pid may go to a child of a new server)."""
    ancestor = os.getpid() if ancestor is None else ancestor
    best: dict[tuple, dict] = {}
    for _, data in read_private_files(".json"):
        try:
            snap = json.loads(data)
            pid = int(snap["pid"])
        except (ValueError, KeyError, TypeError):
            continue
        if not is_descendant(pid, ancestor) or snap.get("start") != process_start(pid):
            continue
        key = (snap.get("role"), snap.get("rank"))
        if key not in best or snap.get("time", 0) > best[key].get("time", 0):
            best[key] = snap
    return list(best.values())


def collect_families(snapshots: list[dict]):
    """Prometheus metric families for the given snapshots."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    labels = ["role", "afd_rank"]
    counters = {
        k: CounterMetricFamily(f"vllm:afd_{k}", doc, labels=labels) for k, doc in COUNTERS.items()
    }
    layers = {
        k: CounterMetricFamily(f"vllm:afd_{k}", doc, labels=[*labels, "layer"])
        for k, doc in LAYER_COUNTERS.items()
    }
    hists = {
        k: HistogramMetricFamily(f"vllm:afd_{k}", doc, labels=labels)
        for k, doc in HISTOGRAMS.items()
    }
    up = GaugeMetricFamily(
        "vllm:afd_peer_up", "1 while the AFD peer is connected, 0 when it is not.",
        labels=[*labels, "peer"],
    )  # fmt: skip
    outage = GaugeMetricFamily(
        "vllm:afd_peer_outage_seconds",
        "Seconds since the AFD FFN rank was lost (0 while it is connected).",
        labels=labels,
    )
    for snap in snapshots:
        role = str(snap.get("role"))
        lv = [role, str(snap.get("rank"))]
        ffn = role == "ffn"
        for k, v in snap.get("counters", {}).items():
            if k in (FFN_COUNTERS if ffn else ATTENTION_COUNTERS):
                counters[k].add_metric(lv, v)
        if ffn:
            for k, per_layer in snap.get("layers", {}).items():
                if k in layers:
                    for layer, v in sorted(per_layer.items(), key=lambda kv: int(kv[0])):
                        layers[k].add_metric([*lv, layer], v)
        for k, h in snap.get("histograms", {}).items():
            if k not in (FFN_HISTOGRAMS if ffn else ATTENTION_HISTOGRAMS):
                continue
            cum, buckets = 0, []
            for bound, c in zip([*map(str, BUCKETS), "+Inf"], h["counts"]):
                cum += c
                buckets.append((bound, cum))
            hists[k].add_metric(lv, buckets, h["sum"])
        for peer, is_up in snap.get("peers", {}).items():
            up.add_metric([*lv, peer], 1.0 if is_up else 0.0)
        if not ffn and isinstance(snap.get("outage_seconds"), (int, float)):
            outage.add_metric(lv, float(snap["outage_seconds"]))
    # Only families with samples: an FFN server shows no attention series.
    families = [*counters.values(), *layers.values(), *hists.values(), up, outage]
    yield from (f for f in families if f.samples)


# /health (patch `health-afd-wait`) runs health_problem() on the API server's event loop: the
# snapshots are read at most once per HEALTH_CACHE_S, the answers between are cached.
HEALTH_CACHE_S = 1.0
_health: tuple[str, float, str | None] | None = None  # (directory, monotonic, answer)


def health_problem(snapshots: list[dict] | None = None) -> str | None:
    """Why this server is alive but not ready, for its /health (patch ``health-afd-wait``): an AFD
    attention rank of it is waiting for its lost FFN rank (its step held, requests queued,
    see vllm.afd.rejoin). None when all is well or the server runs no AFD attention rank.
    ``snapshots``: those of :func:`read_snapshots`; default: this server's, read at most
    once per HEALTH_CACHE_S (the answer in between is the last one)."""
    global _health
    if snapshots is None:
        key, now = str(metrics_dir()), time.monotonic()
        cached = _health
        if cached is not None and cached[0] == key and now - cached[1] < HEALTH_CACHE_S:
            return cached[2]
        answer = health_problem(read_snapshots())
        _health = (key, now, answer)
        return answer
    waiting = []
    for snap in snapshots:
        outage = snap.get("outage_seconds")
        if snap.get("role") == "attention" and isinstance(outage, (int, float)) and outage > 0:
            waiting.append(f"attention rank {snap.get('rank')} ({outage:.1f} s)")
    if not waiting:
        return None
    return (
        f"AFD: waiting for a lost FFN rank to come back: {', '.join(waiting)} since the loss; "
        "requests are held until it rejoins or rejoin_timeout_s passes"
    )


class AFDCollector:
    """prometheus_client collector over the AFD snapshots of this server."""

    def __init__(self, ancestor: int | None = None) -> None:
        self.ancestor = os.getpid() if ancestor is None else ancestor

    def collect(self):
        yield from collect_families(read_snapshots(self.ancestor))

    def describe(self):
        return []  # unchecked collector: names are validated at collect time


def register_prometheus(registry, args) -> None:
    """Hook in vLLM's ``/metrics`` router: add the AFD series when this server
    runs an AFD role."""
    from vllm.config.afd import AFDConfig

    try:
        cfg = AFDConfig.from_engine_args(
            getattr(args, "afd_config", None), getattr(args, "additional_config", None)
        )
    except Exception:  # noqa: BLE001 - the engine reports bad configs itself
        return
    if cfg is not None:
        registry.register(AFDCollector())
