"""scripts/serve_util: the ports tests, the demo and the benchmarks hand to servers, and
the environment of every engine they start."""

from __future__ import annotations

import socket

import pytest

import serve_util as su
from serve_util import engine, ports, server

HOST = "127.0.0.1"
needs_window = pytest.mark.skipif(
    su.ephemeral_port_range()[0] < su.LISTEN_WINDOW_START + 100,
    reason="this host's ephemeral range leaves no window below it",
)


@needs_window
def test_free_ports_lie_below_the_ephemeral_range():
    lo, hi = su.listen_window()
    assert su.LISTEN_WINDOW_START <= lo < hi <= su.ephemeral_port_range()[0]
    seen = set()
    for _ in range(20):
        (p,) = su.free_ports(1)
        assert lo <= p < hi
        seen.add(p)
    assert len(seen) == 20  # never handed out twice
    base = su.free_ports(3, consecutive=True)[0]
    ports = su.free_ports(4)
    assert len(set(ports)) == 4 and not set(ports) & set(range(base, base + 3))
    for p in [*range(base, base + 3), *ports]:
        with socket.socket() as s:
            s.bind((HOST, p))  # free


def test_free_ports_fall_back_to_the_kernel_without_room(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (su.LISTEN_WINDOW_START + 4, 60999))
    base = su.free_ports(2, consecutive=True)[0]
    assert base >= su.LISTEN_WINDOW_START + 4
    with socket.socket() as a, socket.socket() as b:
        a.bind((HOST, base))
        b.bind((HOST, base + 1))


def test_internal_port_bases_never_repeat_within_50_servers(monkeypatch):
    # Once every base was handed out (the old rule then forgot them all at once), a
    # base still in use by a server started a moment earlier could come back.
    monkeypatch.setattr(ports, "_PORT_BASES", [])
    bases = [su.internal_port_base() for _ in range(1000)]
    assert all(20000 <= b < 30000 and b % 100 == 0 for b in bases)
    assert all(len(set(bases[i:i + 51])) == 51 for i in range(len(bases) - 50))
    assert len(set(bases)) == 100  # every base is used again later


@needs_window
def test_a_long_lived_process_does_not_run_out_of_ports(monkeypatch):
    monkeypatch.setattr(ports, "_HANDED_OUT", set())
    lo, hi = su.listen_window()
    got = [su.free_ports(1)[0] for _ in range(hi - lo)]  # as many as the window holds
    assert all(lo <= p < hi for p in got)


@needs_window
def test_a_port_window_of_its_own_for_each_of_two_test_processes(monkeypatch):
    # Halves of this process's own window (make test gives the unit tests a part of it).
    monkeypatch.setattr(ports, "_HANDED_OUT", set())
    lo, hi = su.listen_window()
    top, mid = su.ephemeral_port_range()[0], (lo + hi) // 2
    monkeypatch.setenv(su.PORT_WINDOW_ENV, f"{lo}-{mid}")
    assert su.listen_window() == (lo, mid)
    assert all(lo <= p < mid for p in su.free_ports(40))
    monkeypatch.setenv(su.PORT_WINDOW_ENV, f"{mid}-70000")  # clipped at the ephemeral range
    assert su.listen_window() == (mid, top)
    assert all(mid <= p < top for p in su.free_ports(40))
    monkeypatch.setenv(su.PORT_WINDOW_ENV, "31000")
    with pytest.raises(ValueError, match="AFD_PORT_WINDOW='31000': expected LO-HI"):
        su.free_ports(1)


def test_cuda_visible_devices_of_afd_roles_and_plain_engines():
    # cuda_ipc across two GPUs: each side sees its own GPU first, then its peer's.
    assert su.cuda_visible_devices("0", "1", "cuda_ipc") == "0,1"
    assert su.cuda_visible_devices("1", "0", "ipc") == "1,0"
    # Same GPU, another connector, or a plain engine: only its own GPU.
    assert su.cuda_visible_devices("0", "0", "cuda_ipc") == "0"
    assert su.cuda_visible_devices("1", "0", "nccl") == "1"
    assert su.cuda_visible_devices("1") == "1"


def test_shared_gpu_note_only_for_afd_modes_with_both_roles_on_one_gpu():
    note = su.shared_gpu_note("cuda", ["plain", "afd_dbo"], "0", "0")
    assert note and "both AFD roles on GPU 0" in note and "--ffn-gpu" in note
    assert su.shared_gpu_note("cuda", ["plain", "afd"], "0", "1") is None  # own GPUs
    assert su.shared_gpu_note("cuda", ["plain"], "0", "0") is None  # no AFD run
    assert su.shared_gpu_note("cpu", ["afd"], "0", "0") is None  # CPU: cores, not GPUs
    assert "without MPS" in note and "time-slice" in note
    shared = su.shared_gpu_note("cuda", ["afd"], "0", "0", mps=True)
    assert "under CUDA MPS" in shared and "time-slice" not in shared


def test_routing_env_sets_or_clears_the_strategy():
    assert su.routing_env("balanced") == {su.ROUTING_ENV: "afd_balanced"}
    assert su.routing_env("model") == {su.ROUTING_ENV: ""}  # overrides an inherited one
    with pytest.raises(ValueError, match="unknown routing"):
        su.routing_env("both")


def test_dummy_routing_note_only_for_dummy_weights_with_the_model_router():
    note = su.dummy_routing_note("dummy", ["model", "balanced"])
    assert note and "--routing balanced" in note and "6 of 64" in note
    assert su.dummy_routing_note("dummy", ["balanced"]) is None  # spread already
    assert su.dummy_routing_note("auto", ["model"]) is None  # real (or random) weights


def test_failure_excerpt_ends_with_the_first_tracebacks_error(tmp_path):
    log = tmp_path / "ffn.log"
    log.write_text(
        "INFO starting\n"
        "(Worker pid=7) ERROR 12-02 20:33:45 [multiproc_executor.py:901] Traceback (most recent call last):\n"
        '(Worker pid=7) ERROR 12-02 20:33:45 [multiproc_executor.py:901]   File "x.py", line 1, in f\n'
        "(Worker pid=7) ERROR 12-02 20:33:45 [multiproc_executor.py:901] RuntimeError: create shm failed. errno: 17\n"
        + "".join(f"noise {i}\n" for i in range(100))
        + "Traceback (most recent call last):\n"
        '  File "y.py", line 2, in g\n'
        "Exception: WorkerProc initialization failed\n"
    )
    out = su.failure_excerpt(log, 5)
    assert out.splitlines()[-1].endswith("RuntimeError: create shm failed. errno: 17")
    assert "Exception: WorkerProc initialization failed" in out and "noise 99" in out
    assert "noise 50" not in out
    plain = tmp_path / "ok.log"
    plain.write_text("a\nb\nc\n")
    assert su.failure_excerpt(plain, 2) == "b\nc"


def test_engine_env_of_a_cpu_engine(monkeypatch):
    monkeypatch.setenv("AFD_TEST_INHERITED", "kept")
    monkeypatch.setenv("VLLM_PORT", "12345")  # one base for every engine would collide
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    env = su.engine_env("/models/deepseek_v2", in_process=True)
    assert env["AFD_TEST_INHERITED"] == "kept"
    assert {k: env[k] for k in su.ENGINE_ENV} == su.ENGINE_ENV
    assert env["VLLM_MLA_DISABLE"] == "1"  # the CPU backend has no MLA
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    ports = {su.engine_env()["VLLM_PORT"] for _ in range(20)} | {env["VLLM_PORT"]}
    assert len(ports) == 21 and all(20000 <= int(p) < 30000 for p in ports)


def test_engine_env_without_a_cpu_model_and_with_extra(monkeypatch):
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    env = su.engine_env(extra={"VLLM_PORT": "31000", "VLLM_CPU_KVCACHE_SPACE": "4"})
    assert "VLLM_MLA_DISABLE" not in env  # a GPU engine, or the caller decides
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert env["VLLM_PORT"] == "31000" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "VLLM_MLA_DISABLE" not in su.engine_env("/models/qwen3_moe")


def test_server_start_runs_in_the_engine_env(monkeypatch, tmp_path):
    seen = {}

    def start_process(cmd, log_path, env=None):
        seen.update(cmd=cmd, env=env)
        return None

    monkeypatch.setattr(server, "start_process", start_process)
    monkeypatch.setattr(engine, "vllm_cli", lambda python=None: ["vllm"])
    su.Server.start("ffn", "/models/deepseek_v2", 31001, tmp_path / "ffn.log",
                    env={"VLLM_AFD_SECRET": "s"})  # fmt: skip
    env = seen["env"]
    assert env["VLLM_AFD_SECRET"] == "s" and 20000 <= int(env["VLLM_PORT"]) < 30000
    assert {k: env[k] for k in su.ENGINE_ENV} == su.ENGINE_ENV
    assert seen["cmd"][:3] == ["vllm", "serve", "/models/deepseek_v2"]
