"""``python -m vllm.afd.deploy`` on a real multi-node Ray cluster on this machine: a head
(127.0.0.1, the attention slots' Ray resource) and two worker nodes (127.0.0.2 and
127.0.0.3, each its own raylet with the FFN's Ray resource ``afd_ffn``), every node's
processes marked by an environment variable so that a node can be killed whole.

One test, in order (the engine starts are shared: plain vLLM once, the FFN rank twice, three
attention slots):

1. ``up`` a 2A1F topology of the qwen3_moe test checkpoint (CPU engines, connector gloo,
   three attention slots of which two run): the supervisor places the FFN rank on a worker
   node and both attention ranks on the head, and prints the endpoints.
2. Both ranks stream greedy requests; the whole node running the FFN rank is SIGKILLed (its
   raylet, its Ray workers, its ``vllm serve``): the supervisor starts the FFN rank on the
   other worker node and points the attention ranks' relays there; the ranks rejoin it and
   every stream completes with plain vLLM's tokens; ``status`` shows the FFN rank on the
   other node with one restart.
3. ``scale attention 3`` while requests flow on the two ranks: the third slot starts and
   serves; ``scale attention 2`` while the third slot streams: it is drained (its streams
   complete) and stopped. Every stream has plain vLLM's tokens.
4. ``down``: no ``vllm serve`` process and no actor of the deployment is left.

Printed: the time from the loss to the FFN rank healthy on the other node, to the attention
ranks' rejoin and to the first token after it; requests lost; tokens compared; the scale
times; the test's wall time.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import (
    TokenStream,
    first_token_after,
    free_afd_port,
    join_streams,
    module_log_dir,
    start_plain,
    wait_for,
)

import serve_util as su

pytestmark = [pytest.mark.cpu_e2e, pytest.mark.timeout(900)]

MODEL = "qwen3_moe"
NODE_MARK = "AFD_TEST_RAY_NODE"
HEAD, NODE_A, NODE_B = "127.0.0.1", "127.0.0.2", "127.0.0.3"
AFD_TIMEOUT_S = 60.0
REJOIN_TIMEOUT_S = 180.0  # the FFN rank's start on the other node (2 busy cores)
START_TIMEOUT_S = 420.0
STREAM_TOKENS = 96
PROMPTS = [f"Story number {i}: once upon a time" for i in range(4)]
# The GCS marks a node dead after 3 missed health checks 0.5 s apart (default: 5 x 3 s).
RAY_SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                     "health_check_initial_delay_ms": 0}  # fmt: skip

log_dir = module_log_dir("afd_deploy_ray_logs")


class Endpoint:
    """An attention server of the deployment, as TokenStream needs it."""

    def __init__(self, name: str, url: str):
        self.name, self.url = name, url


def marked_processes(value: str | None = None) -> list[int]:
    """Pids whose environment has NODE_MARK (= ``value`` when given)."""
    want = f"{NODE_MARK}=".encode() + (value.encode() if value is not None else b"")
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if any(e == want or (value is None and e.startswith(want)) for e in env):
            out.append(int(entry))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class RayNodes:
    """A head and two worker nodes (ray.cluster_utils.Cluster: a raylet each), every node's
    processes marked with NODE_MARK=<its IP>."""

    def __init__(self, secret: str):
        from ray.cluster_utils import Cluster

        os.makedirs("/tmp/ray", exist_ok=True)  # Ray writes the address of its last cluster there
        common = {"include_dashboard": False}
        # PYTHONFAULTHANDLER: a stuck engine process says where it was (engine_stacks)
        env = {"VLLM_AFD_SECRET": secret, "PYTHONFAULTHANDLER": "1"}
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=4, node_ip_address=HEAD, resources={"afd_attention": 3},
            _system_config=RAY_SYSTEM_CONFIG,
            env_vars={NODE_MARK: HEAD, **env}, **common))  # fmt: skip
        self.workers = {
            ip: self.cluster.add_node(num_cpus=2, node_ip_address=ip, resources={"afd_ffn": 1},
                                      env_vars={NODE_MARK: ip, **env})
            for ip in (NODE_A, NODE_B)
        }  # fmt: skip
        self.address = self.cluster.address

    def kill(self, ip: str) -> int:
        """SIGKILL every process of node ``ip`` at once (its raylet, Ray workers, servers)."""
        pids = marked_processes(ip)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node = self.workers.pop(ip)
        try:
            self.cluster.remove_node(node, allow_graceful=False)
        except Exception as e:  # noqa: BLE001 - the processes are gone already
            print(f"remove_node({ip}): {e!r}")
        return len(pids)

    def shutdown(self) -> None:
        """Every node removed; Ray's agents that outlive their raylet are SIGKILLed too."""
        import ray

        ray.shutdown()
        for node in list(self.workers.values()):
            try:
                self.cluster.remove_node(node, allow_graceful=False)
            except Exception as e:  # noqa: BLE001
                print(f"remove_node: {e!r}")
        if self.cluster.head_node is not None:
            self.cluster.remove_node(self.cluster.head_node, allow_graceful=False)
        for pid in marked_processes():
            if "vllm" not in cmdline(pid):
                os.kill(pid, signal.SIGKILL)


def topology(model_dir: Path, logs: Path) -> dict:
    http = su.free_ports(4)
    env = {**su.ENGINE_ENV, "TORCHDYNAMO_DISABLE": "1"}
    return {
        "name": "t2a1f",
        "model": str(model_dir),
        "connector": "gloo",
        "afd": {"timeout_s": AFD_TIMEOUT_S, "rejoin_timeout_s": REJOIN_TIMEOUT_S},
        "env": env,
        "attention": {"ranks": 2, "max_ranks": 3, "serve_args": su.CPU_SERVE_ARGS,
                      "http_port": http[0],
                      "resources": {"cpus": 1, "ray_resources": {"afd_attention": 1}}},
        "ffn": {"ranks": 1, "serve_args": su.CPU_SERVE_ARGS, "http_port": http[3],
                "afd_port": free_afd_port(),
                "resources": {"cpus": 1, "ray_resources": {"afd_ffn": 1}}},
        "ray": {"log_dir": str(logs), "start_timeout_s": START_TIMEOUT_S,
                "health_period_s": 0.5,
                "internal_port_base": random.SystemRandom().randrange(20000, 29400, 100)},
    }  # fmt: skip


def cli(*args: str, env: dict[str, str], timeout: float) -> tuple[dict, float]:
    """``python -m vllm.afd.deploy ARGS --json`` (the installed wheel); its JSON and seconds."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "vllm.afd.deploy", *args, "--json"], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    took = time.monotonic() - t0
    assert proc.returncode == 0, f"deploy {args}: rc {proc.returncode}\n{proc.stderr[-4000:]}"
    # vLLM's import logs share stdout: the JSON starts at the first line that is "{".
    lines = proc.stdout.splitlines()
    return json.loads("\n".join(lines[lines.index("{"):])), took


def row(status: dict, server: str) -> dict:
    return next(r for r in status["servers"] if r["server"] == server)


def engine_stacks(servers: Path) -> str:
    """A stream stalled or failed: SIGABRT to every engine core and worker of the deployment
    (PYTHONFAULTHANDLER=1 on every node: each writes the tracebacks of all its threads to
    its server's log as it ends), then those tracebacks: where a stuck process was."""
    pids = [p for p in marked_processes() if cmdline(p).startswith("VLLM::")]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
    time.sleep(3)
    dumps = []
    for log in sorted(servers.glob("*.log")):
        text = log.read_text(errors="replace")
        dumps += [f"== {log.name}\n{text[m.start():m.start() + 8000]}"
                  for m in re.finditer("Fatal Python error: Aborted", text)]  # fmt: skip
    return f"stacks of {len(pids)} engine processes:\n" + "\n".join(dumps)


def assert_complete(streams: list[TokenStream], want: dict[str, list[int]],
                    servers: Path) -> int:  # fmt: skip
    """No stream failed; each has plain vLLM's greedy tokens. Returns the tokens compared."""
    running = join_streams(streams, 300)
    if running or any(s.result is None or s.result["error"] is not None for s in streams):
        print(engine_stacks(servers))
    assert not running, [(s.srv.name, s.prompt) for s in running]
    for s in streams:
        assert s.result["error"] is None and s.result["done"], (s.srv.name, s.result)
        assert s.result["finish_reason"] == "length", (s.srv.name, s.result)
        assert s.ids == want[s.prompt], f"{s.srv.name} {s.prompt!r}: tokens differ from plain"
    return sum(len(s.ids) for s in streams)


def test_ray_deploy_node_lost_scale_down(model_dir, log_dir, monkeypatch):
    t_test = time.monotonic()
    secret = os.urandom(16).hex()
    # Ray resolves 127.0.0.1 to this host's outward address unless told it runs on one
    # machine: all its traffic stays on the loopback addresses.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no report leaves this machine
    reference = start_plain(model_dir, log_dir,
                            {"prompts": PROMPTS, "max_tokens": [STREAM_TOKENS] * len(PROMPTS)})
    nodes = RayNodes(secret)
    topo_path = log_dir / "topology.json"
    topo = topology(model_dir, log_dir / "servers")
    topo_path.write_text(json.dumps(topo, indent=2))
    env = {**os.environ, "VLLM_AFD_SECRET": secret}
    ray_args = ["--address", nodes.address]
    figures: dict[str, object] = {}
    from vllm.afd.deploy import ray_launcher as rl

    try:
        # 1. up: FFN rank on a worker node, two attention ranks on the head.
        st, figures["up_s"] = cli("up", str(topo_path), *ray_args, env=env, timeout=START_TIMEOUT_S + 120)
        ffn_ip = row(st, "ffn-0")["node"]
        assert ffn_ip in (NODE_A, NODE_B), st
        assert [row(st, f"attention-{a}")["health"] for a in range(3)] == \
            ["healthy", "healthy", "stopped"], st  # fmt: skip
        assert all(row(st, f"attention-{a}")["node"] == HEAD for a in range(2)), st
        assert len(st["endpoints"]) == 2, st
        want = dict(zip(PROMPTS, (o["token_ids"] for o in
                                  reference.output(START_TIMEOUT_S)["outputs"])))  # fmt: skip
        att = [Endpoint(f"attention-{a}", row(st, f"attention-{a}")["address"]) for a in range(2)]
        ns = "afd-t2a1f"  # the default namespace: afd-<name>

        # 2. Both ranks stream; the FFN rank's node dies whole.
        streams = [TokenStream(att[i // 2], p, STREAM_TOKENS) for i, p in enumerate(PROMPTS)]
        wait_for(lambda: all(s.ids for s in streams), 120, "a token on every stream", poll=0.02)
        t_loss = time.monotonic()
        mid = sum(len(s.ids) < STREAM_TOKENS for s in streams)
        killed = nodes.kill(ffn_ip)
        other = NODE_B if ffn_ip == NODE_A else NODE_A

        def ffn_back():
            r = row(rl.status(ns, nodes.address), "ffn-0")
            return r if r["health"] == "healthy" and r["node"] == other else None

        r = wait_for(ffn_back, REJOIN_TIMEOUT_S, "the FFN rank healthy on the other node", poll=0.5)
        t_healthy = time.monotonic()
        assert r["restarts"] == 1, r
        compared = assert_complete(streams, want, log_dir / "servers")
        rejoin = [float(m.group(1)) for a in range(2) for m in re.finditer(
            r"rejoined FFN rank 0 at .*? after ([0-9.]+) s without it",
            (log_dir / "servers" / f"attention-{a}-g1.log").read_text(errors="replace"))]  # fmt: skip
        assert len(rejoin) == 2, rejoin
        first = first_token_after(streams, t_loss + max(rejoin))
        figures.update(
            node_killed=ffn_ip, processes_killed=killed, streams_mid_decode=mid,
            loss_to_ffn_healthy_s=round(t_healthy - t_loss, 1),
            loss_to_rejoin_s=[round(x, 1) for x in rejoin],
            loss_to_first_token_after_rejoin_s=round(first - t_loss, 1) if first else None,
            requests_lost=0, tokens_compared_loss=compared)  # fmt: skip
        assert mid == len(streams), "every stream was mid-decode at the loss"
        st = rl.status(ns, nodes.address)
        print(rl.format_status(st))  # what `status` shows the operator after the loss
        assert row(st, "ffn-0")["node"] == other and st["restarts"] == 1, st
        assert [e["server"] for e in st["events"] if e["what"] == "lost"] == ["ffn-0"], st["events"]

        # 3. scale attention 3 while both ranks stream, then 2 while the third streams.
        flowing = [TokenStream(att[0], PROMPTS[0], STREAM_TOKENS),
                   TokenStream(att[1], PROMPTS[1], STREAM_TOKENS)]  # fmt: skip
        st, figures["scale_to_3_s"] = cli("scale", "attention", "3", "--namespace", ns,
                                          *ray_args, env=env, timeout=START_TIMEOUT_S + 60)  # fmt: skip
        assert row(st, "attention-2")["health"] == "healthy" and len(st["endpoints"]) == 3, st
        att.append(Endpoint("attention-2", row(st, "attention-2")["address"]))
        third = [TokenStream(att[2], p, STREAM_TOKENS) for p in PROMPTS[2:]]
        wait_for(lambda: all(s.ids for s in third), 120, "a token on the third slot", poll=0.02)
        flowing += [TokenStream(att[0], PROMPTS[3], STREAM_TOKENS)]
        st, figures["scale_to_2_s"] = cli("scale", "attention", "2", "--namespace", ns,
                                          *ray_args, env=env, timeout=300)  # fmt: skip
        assert all(not s.is_alive() for s in third), "slot 2 stopped before its streams ended"
        figures["tokens_compared_scale"] = assert_complete(flowing + third, want,
                                                           log_dir / "servers")
        assert row(st, "attention-2")["health"] == "stopped" and len(st["endpoints"]) == 2, st
        stopped = [e for e in st["events"] if e["what"] == "stopped"]
        assert [(e["server"], e["drained"]) for e in stopped] == [("attention-2", True)], stopped

        # 4. down: nothing of the deployment is left.
        out, figures["down_s"] = cli("down", "--namespace", ns, *ray_args, env=env, timeout=300)
        assert sorted(out["stopped"]) == ["attention-0", "attention-1", "ffn-0"], out
        servers = [p for p in marked_processes() if "vllm.entrypoints" in cmdline(p)]
        assert not servers, [cmdline(p) for p in servers]
        from ray.util import list_named_actors

        assert not [a for a in list_named_actors(all_namespaces=True) if a["namespace"] == ns]
    finally:
        with_left = None
        try:
            subprocess.run([sys.executable, "-m", "vllm.afd.deploy", "down", "--namespace",
                            "afd-t2a1f", *ray_args], env=env, capture_output=True, timeout=300)  # fmt: skip
        finally:
            nodes.shutdown()
            reference.stop()
            deadline = time.monotonic() + 30
            while (with_left := [p for p in marked_processes() if "vllm" in cmdline(p)]) \
                    and time.monotonic() < deadline:  # fmt: skip
                time.sleep(0.5)
        figures["wall_s"] = round(time.monotonic() - t_test, 1)
        print(f"deploy figures: {json.dumps(figures)}")
        assert not with_left, [cmdline(p) for p in with_left]
