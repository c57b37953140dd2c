"""AFD across two network namespaces joined by a veth pair (needs root and `ip netns`).

The FFN rank runs in namespace B and binds its veth address 10.X.Y.2; the attention rank
runs in namespace A (10.X.Y.1) and connects to it over the veth link, so the AFD traffic
leaves the loopback device. Both are the offline harness (tests/cpu/afd_proc.py, through
harness.AfdProc) run with `ip netns exec`.

* the CPU oracle across the link: greedy tokens identical to plain vLLM, top-5 logprobs
  within LOGPROB_TOL; the FFN is not reachable on 127.0.0.1 of its namespace (it binds
  only the configured address);
* the FFN rank SIGKILLed during a generation and started again on its address 2 s later:
  the attention rank rejoins it across the link and ends with plain vLLM's tokens;
* a network cut (`ip -n B link set <veth> down`) during a long generation, with
  ``rejoin_timeout_s`` 0: the attention rank ends non-zero within timeout_s + 5 s, naming its
  FFN peer; the FFN rank drops that attention rank within the same bound and serves on.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import AfdProc, start_plain
from oracle_lib import LOGPROB_TOL, assert_outputs_match

import serve_util as su

pytestmark = pytest.mark.cpu_e2e

MODEL = "qwen3_moe"
START_TIMEOUT_S = 420
CUT_TIMEOUT_S = 5
SPEC = {
    "prompts": [
        "Hello, my name is",
        "The capital of France is",
        "def add(a, b):",
        "A long time ago in a galaxy far, far away, there was a small robot who",
        "Q: What is two plus two?\nA:",
        "In the beginning",
    ],
    "max_tokens": [24, 8, 30, 12, 20, 6],
}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)  # fmt: skip


@dataclass
class NetNS:
    a: str  # attention namespace
    b: str  # FFN namespace
    veth_a: str
    veth_b: str
    addr_a: str
    addr_b: str
    c: str = ""  # a third host (a second FFN replica)
    veth_c: str = ""
    addr_c: str = ""
    # Names every namespace resolves (its own /etc/hosts, `ip netns exec` mounts it)
    names: dict[str, str] | None = None


def _made_namespace(name: str, dev: str, addr: str, bridge: str, hosts: str) -> None:
    """Namespace ``name`` on the bridge: its end of a veth pair (``dev``) at ``addr``, the
    other end on ``bridge`` in this namespace, its own /etc/hosts."""
    _ip("netns", "add", name)
    _ip("link", "add", dev, "type", "veth", "peer", "name", dev + "h")
    _ip("link", "set", dev, "netns", name)
    _ip("link", "set", dev + "h", "master", bridge)
    _ip("link", "set", dev + "h", "up")
    _ip("-n", name, "addr", "add", f"{addr}/24", "dev", dev)
    _ip("-n", name, "link", "set", "lo", "up")
    _ip("-n", name, "link", "set", dev, "up")
    etc = Path("/etc/netns") / name
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "hosts").write_text(hosts)


@pytest.fixture(scope="module")
def netns():
    """Three namespaces (hosts) A, B, C on one bridge, each with a veth address 10.X.Y.1-3
    and the names ffn-0.afd.test (B) and ffn-1.afd.test (C) in its own /etc/hosts."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (os.geteuid() != 0)")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is not installed")
    rng = random.Random()
    tag = f"{os.getpid() % 1000:03d}{rng.randrange(1000):03d}"
    x, y = rng.randrange(100, 250), rng.randrange(1, 250)
    ns = NetNS(a=f"afdA{tag}", b=f"afdB{tag}", veth_a=f"afva{tag}", veth_b=f"afvb{tag}",
               addr_a=f"10.{x}.{y}.1", addr_b=f"10.{x}.{y}.2", c=f"afdC{tag}",
               veth_c=f"afvc{tag}", addr_c=f"10.{x}.{y}.3")  # fmt: skip
    ns.names = {"ffn-0.afd.test": ns.addr_b, "ffn-1.afd.test": ns.addr_c}
    hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in ns.names.items())
    bridge = f"afbr{tag}"
    made: list[str] = []
    try:
        r = _ip("link", "add", bridge, "type", "bridge", check=False)
        if r.returncode != 0:
            pytest.skip(f"`ip link add type bridge` failed: {r.stderr.strip()}")
        _ip("link", "set", bridge, "up")
        for name, dev, addr in ((ns.a, ns.veth_a, ns.addr_a), (ns.b, ns.veth_b, ns.addr_b),
                                (ns.c, ns.veth_c, ns.addr_c)):  # fmt: skip
            made.append(name)
            _made_namespace(name, dev, addr, bridge, hosts)
        print(f"namespaces {ns.a} ({ns.addr_a}), {ns.b} ({ns.addr_b}), {ns.c} ({ns.addr_c}) "
              f"on bridge {bridge}")
        yield ns
    finally:
        for name in made:
            # processes still in the namespace (only ours can be there) end with it
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            deadline = time.monotonic() + 10  # a large process takes a while to exit
            while _ip("netns", "pids", name, check=False).stdout.split() and (
                time.monotonic() < deadline
            ):
                time.sleep(0.1)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        # a namespace's devices go with it asynchronously: delete the bridge-side ends of
        # the veth pairs (each takes its peer along) and the bridge, then wait for them
        ours = {dev + "h" for dev in (ns.veth_a, ns.veth_b, ns.veth_c)} | {bridge}
        for dev in sorted(ours):
            _ip("link", "del", dev, check=False)
        deadline = time.monotonic() + 15
        while (still := ours & _link_names()) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _ip("netns", "list", check=False).stdout
        assert not any(n in left for n in made), left
        assert not still, f"links left behind: {sorted(still)}"


def _link_names() -> set[str]:
    """The names of this namespace's network devices (``veth@peer`` as ``veth``)."""
    out = _ip("-o", "link", "show", check=False).stdout
    return {ln.split(":")[1].strip().split("@")[0] for ln in out.splitlines() if ":" in ln}


def afd(role: str, host: str, port: int, timeout_s: float, **extra) -> str:
    return json.dumps(su.afd_config(role, port=port, host=host, timeout_s=timeout_s, **extra))


def assert_matches(plain: dict, got: dict) -> float:
    return assert_outputs_match(plain, got, SPEC["max_tokens"], LOGPROB_TOL)


def _connect_from(ns: str, host: str, port: int) -> str:
    code = ("import socket, sys\n"
            "try:\n"
            f"    socket.create_connection(({host!r}, {port}), timeout=3).close(); print('open')\n"
            "except OSError as e:\n"
            "    print(type(e).__name__)\n")  # fmt: skip
    r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    return r.stdout.strip() or r.stderr.strip()


def test_oracle_across_namespaces(netns, model_dir, plain, tmp_path, procs):
    """Connector nixl across the link, the FFN rank reached by name (ffn_addresses)."""
    port = su.free_port()
    nixl = {"connector": "nixl", "ffn_addresses": [f"ffn-0.afd.test:{port}"]}
    (tmp_path / "prompts.json").write_text(json.dumps(SPEC))
    ffn = AfdProc("ffn", model_dir, tmp_path / "ffn.log",
                  ["--afd", afd("ffn", netns.addr_b, port, 120, **nixl)], netns=netns.b)
    procs.append(ffn)
    attn = AfdProc("attention", model_dir, tmp_path / "attn.log",
                   ["--afd", afd("attention", "0.0.0.0", port, 120, **nixl),
                    "--prompts", str(tmp_path / "prompts.json"),
                    "--out", str(tmp_path / "afd.json"), "--max-num-seqs", "4"],
                   netns=netns.a)  # fmt: skip
    procs.append(attn)
    t0 = time.monotonic()
    rc = attn.wait_exit(START_TIMEOUT_S)
    assert rc == 0, attn.tail() + "\n--- ffn ---\n" + ffn.tail()
    worst = assert_matches(plain(), json.loads((tmp_path / "afd.json").read_text()))
    text = ffn.text()
    assert f"listening on {netns.addr_b}:{port}" in text, ffn.tail()
    assert f"accepted attention rank 0 from {netns.addr_a}:" in text, ffn.tail()
    assert "said goodbye" in text, ffn.tail()
    assert "nixl agent afd-ffn0-" in text, ffn.tail()
    assert f"connected to FFN rank 0 at ffn-0.afd.test:{port}" in attn.text(), attn.tail()
    assert ffn.p.poll() is None, "the FFN must keep serving after the attention goodbye"
    # it binds only the configured address: nothing listens on its namespace's loopback
    assert _connect_from(netns.b, "127.0.0.1", port) == "ConnectionRefusedError"
    assert _connect_from(netns.a, netns.addr_b, port) == "open"  # while on the veth it is
    print(f"AFD (nixl, by name) across namespaces: tokens identical, max |logprob diff| {worst:.2e}, "
          f"{time.monotonic() - t0:.0f} s")  # fmt: skip
    assert ffn.stop() == 0, ffn.tail()
    assert "AFD-FFN-STOPPED" in ffn.text()


# Long enough that the FFN kill below lands in a step on any machine (a step is a few ms).
SPEC_LONG = {"prompts": SPEC["prompts"][:4], "max_tokens": [160] * 4}


def plain_beside(model_dir: Path, d: Path, spec: dict):
    """Plain vLLM's output on ``spec``, read by calling what this yields. The engine starts
    at once and runs beside the AFD pair the test starts next (engine start-up is mostly
    one thread each); it is stopped at the end."""
    p = start_plain(model_dir, d, spec, max_num_seqs=4)
    out: list[dict] = []

    def result() -> dict:
        if not out:
            out.append(p.output(START_TIMEOUT_S))
        return out[0]

    try:
        yield result
    finally:
        p.stop()


@pytest.fixture(scope="module")
def plain(model_dir, tmp_path_factory) -> Iterator[Callable[[], dict]]:
    yield from plain_beside(model_dir, tmp_path_factory.mktemp("netns_plain"), SPEC)


@pytest.fixture(scope="module")
def plain_long(model_dir, tmp_path_factory) -> Iterator[Callable[[], dict]]:
    yield from plain_beside(model_dir, tmp_path_factory.mktemp("netns_plain_long"), SPEC_LONG)


def test_ffn_restart_across_namespaces(netns, model_dir, plain_long, tmp_path, procs):
    """Connector nixl: the FFN rank (namespace B, its veth address) is SIGKILLed while the
    attention rank (namespace A) generates, and started again 2 s after it is gone (a new
    NIXL agent): the attention rank holds its step, rejoins it across the link and finishes
    with plain vLLM's tokens."""
    port = su.free_port()
    (tmp_path / "prompts.json").write_text(json.dumps(SPEC_LONG))

    def start_ffn(n: int) -> AfdProc:
        ffn = AfdProc("ffn", model_dir, tmp_path / f"ffn{n}.log",
                      ["--afd", afd("ffn", netns.addr_b, port, 60, connector="nixl")],
                      netns=netns.b)  # fmt: skip
        procs.append(ffn)
        return ffn

    ffn = start_ffn(1)
    attn = AfdProc("attention", model_dir, tmp_path / "attn.log",
                   ["--afd", afd("attention", netns.addr_b, port, 60, rejoin_timeout_s=300,
                                 connector="nixl"),
                    "--prompts", str(tmp_path / "prompts.json"),
                    "--out", str(tmp_path / "afd.json"), "--max-num-seqs", "4"],
                   netns=netns.a)  # fmt: skip
    procs.append(attn)
    assert attn.wait_for_log("AFD-PROC-GENERATING", START_TIMEOUT_S), (
        attn.tail() + "\n--- ffn ---\n" + ffn.tail()
    )
    t_kill = time.monotonic()
    ffn.kill()
    assert ffn.gone()
    time.sleep(2.0)  # the outage (the FFN server is gone)
    assert attn.p.poll() is None, attn.tail()
    new_ffn = start_ffn(2)
    rc = attn.wait_exit(START_TIMEOUT_S)
    took = time.monotonic() - t_kill
    assert rc == 0, attn.tail() + "\n--- new ffn ---\n" + new_ffn.tail()
    text = attn.text()
    peer = f"FFN rank 0 at {netns.addr_b}:{port}"
    assert "holding the step and rejoining" in text, attn.tail()
    assert f"attention rank 0 rejoined {peer}" in text, attn.tail()
    assert f"accepted attention rank 0 from {netns.addr_a}:" in new_ffn.text(), new_ffn.tail()
    worst = assert_outputs_match(plain_long(), json.loads((tmp_path / "afd.json").read_text()),
                                 SPEC_LONG["max_tokens"], LOGPROB_TOL)  # fmt: skip
    line = next(ln for ln in text.splitlines() if "rejoined" in ln)
    print(f"FFN restart across namespaces: tokens identical, max |logprob diff| {worst:.2e}; "
          f"{line.split('AFD: ')[-1]}; generation done {took:.0f} s after the kill")  # fmt: skip
    assert new_ffn.stop() == 0, new_ffn.tail()


def test_ffn_replica_failover_across_three_hosts(netns, model_dir, plain_long, tmp_path, procs):
    """Connector nixl, FFN replicas on two hosts reached by name (ffn_addresses with
    ffn_failover): FFN replica 0 on host B (ffn-0.afd.test), replica 1 on host C
    (ffn-1.afd.test); attention rank 0 on host A, attention rank 1 on host C. Replica 1 is
    SIGKILLed while both ranks generate: rank 1 fails over to replica 0 on host B and both
    finish with plain vLLM's tokens (no request lost); replica 1 is started again, rank 1
    moves back home, and its second round is served there, again with plain's tokens."""
    port = su.free_port()
    topo = {"connector": "nixl", "num_attention_ranks": 2, "num_ffn_ranks": 2,
            "ffn_addresses": [f"ffn-0.afd.test:{port}", f"ffn-1.afd.test:{port}"],
            "connector_extra_config": {"ffn_failover": True}}  # fmt: skip
    (tmp_path / "prompts.json").write_text(json.dumps(SPEC_LONG))
    again = tmp_path / "again"

    def start_ffn(rank: int, tag: str) -> AfdProc:
        host, ns = (netns.addr_b, netns.b) if rank == 0 else (netns.addr_c, netns.c)
        p = AfdProc("ffn", model_dir, tmp_path / f"ffn{rank}{tag}.log",
                    ["--afd", afd("ffn", host, port, 60, rank=rank, **topo)], netns=ns)
        procs.append(p)
        return p

    def start_attention(rank: int, ns: str) -> AfdProc:
        p = AfdProc("attention", model_dir, tmp_path / f"attn{rank}.log",
                    ["--afd", afd("attention", "0.0.0.0", port, 60, rank=rank,
                                  rejoin_timeout_s=120, **topo),
                     "--prompts", str(tmp_path / "prompts.json"),
                     "--out", str(tmp_path / f"afd{rank}.json"), "--max-num-seqs", "4",
                     *(["--again-when", str(again), "--again-out",
                        str(tmp_path / f"afd{rank}.again.json")] if rank == 1 else [])],
                    netns=ns)  # fmt: skip
        procs.append(p)
        return p

    ffn0, ffn1 = start_ffn(0, ""), start_ffn(1, "")
    attn0, attn1 = start_attention(0, netns.a), start_attention(1, netns.c)
    for a in (attn0, attn1):
        assert a.wait_for_log("AFD-PROC-GENERATING", START_TIMEOUT_S), (
            a.tail() + "\n--- ffn0 ---\n" + ffn0.tail() + "\n--- ffn1 ---\n" + ffn1.tail()
        )
    t_kill = time.monotonic()
    ffn1.kill()
    assert ffn1.gone()
    # both first rounds end with plain's tokens: rank 1's on its guest replica
    assert attn0.wait_exit(START_TIMEOUT_S) == 0, attn0.tail()
    assert attn1.wait_for_log("AFD-PROC-ROUND-DONE", START_TIMEOUT_S), attn1.tail()
    done_s = time.monotonic() - t_kill
    for rank in (0, 1):
        assert_outputs_match(plain_long(), json.loads((tmp_path / f"afd{rank}.json").read_text()),
                             SPEC_LONG["max_tokens"], LOGPROB_TOL)  # fmt: skip
    home0 = f"FFN rank 0 at ffn-0.afd.test:{port}"
    home1 = f"FFN rank 1 at ffn-1.afd.test:{port}"
    guest = f"took attention rank 1 from {netns.addr_c}:"
    assert guest in ffn0.text(), ffn0.tail()
    # the replica comes back; rank 1 moves back home and its next round is served there
    t_back = time.monotonic()
    new_ffn1 = start_ffn(1, "-new")
    moved = f"attention rank 1 moved back from {home0} to its own {home1}"
    assert attn1.wait_for_log(moved, START_TIMEOUT_S), attn1.tail() + new_ffn1.tail()
    back_s = time.monotonic() - t_back
    again.touch()
    assert attn1.wait_exit(START_TIMEOUT_S) == 0, attn1.tail()
    assert_outputs_match(plain_long(),
                         json.loads((tmp_path / "afd1.again.json").read_text()),
                         SPEC_LONG["max_tokens"], LOGPROB_TOL)  # fmt: skip
    assert new_ffn1.stop() == 0, new_ffn1.tail()
    served = [ln for ln in new_ffn1.text().splitlines() if "AFD-FFN-STOPPED" in ln][-1]
    assert int(served.split("steps=")[1].split()[0]) > 0, served
    assert ffn0.stop() == 0, ffn0.tail()
    print(f"three hosts, nixl: replica 1 killed; both first rounds done {done_s:.1f} s "
          f"later, 8 of 8 requests with plain's tokens; the new replica 1 took rank 1 back "
          f"{back_s:.1f} s after its start; second round: {served.split('AFD-FFN-STOPPED ')[-1]}")


def test_network_cut_ends_the_attention_side_and_the_ffn_drops_the_rank(netns, model_dir, tmp_path, procs):
    port = su.free_port()
    # 64 requests of 480 tokens, 4 at a time: the generation cannot end before the cut
    spec = {"prompts": ["Hello, my name is"] * 64, "max_tokens": [480] * 64}
    (tmp_path / "prompts.json").write_text(json.dumps(spec))
    ffn = AfdProc("ffn", model_dir, tmp_path / "ffn.log",
                  ["--afd", afd("ffn", netns.addr_b, port, CUT_TIMEOUT_S)], netns=netns.b)
    procs.append(ffn)
    attn = AfdProc("attention", model_dir, tmp_path / "attn.log",
                   # rejoin_timeout_s 0: the cut's bound is timeout_s (no wait for a rejoin)
                   ["--afd", afd("attention", netns.addr_b, port, CUT_TIMEOUT_S,
                                 rejoin_timeout_s=0),
                    "--prompts", str(tmp_path / "prompts.json"),
                    "--out", str(tmp_path / "afd.json"), "--max-num-seqs", "4"],
                   netns=netns.a)  # fmt: skip
    procs.append(attn)
    assert attn.wait_for_log("AFD-PROC-GENERATING", START_TIMEOUT_S), (
        attn.tail() + "\n--- ffn ---\n" + ffn.tail()
    )
    time.sleep(1.0)  # generation under way (not a proof of anything)
    assert attn.p.poll() is None and ffn.p.poll() is None, attn.tail() + ffn.tail()
    _ip("-n", netns.b, "link", "set", netns.veth_b, "down")
    t_cut = time.monotonic()
    bound = CUT_TIMEOUT_S + 5
    rc = attn.wait_exit(bound + 30)
    attn_s = time.monotonic() - t_cut
    # The FFN rank survives the loss of an attention rank (it serves the others and takes
    # this one again when its server reconnects): it drops the rank within the bound and
    # keeps running.
    lost = "FFN rank 0 lost attention rank 0 ("
    seen = ffn.wait_for_log(lost, max(0.0, bound + 30 - attn_s))
    ffn_s = time.monotonic() - t_cut  # when the drop was seen (an upper bound)
    try:
        attn_err = [ln for ln in attn.text().splitlines() if "AFD" in ln and "FFN rank 0" in ln]
        ffn_lost = [ln for ln in ffn.text().splitlines() if lost in ln]
        print(
            f"cut: attention ended after {attn_s:.1f} s rc={rc}: "
            f"{attn_err[-1][-200:] if attn_err else attn.tail(5)}"
        )
        print(f"cut: FFN dropped the rank: {ffn_lost[-1][-200:] if ffn_lost else ffn.tail(5)}")
        assert rc is not None and rc != 0, attn.tail()
        assert attn_s <= bound, f"attention took {attn_s:.1f} s to fail after the cut"
        assert not (tmp_path / "afd.json").exists()
        peer = f"FFN rank 0 at {netns.addr_b}:{port}"
        assert any(peer in ln for ln in attn_err), attn.tail()
        assert seen is not None and ffn_s <= bound, (ffn_s, ffn.tail())
        assert f"attention rank 0 at {netns.addr_a}:" in ffn_lost[-1], ffn.tail()
        assert ffn.p.poll() is None, ffn.tail()  # still serving
    finally:
        _ip("-n", netns.b, "link", "set", netns.veth_b, "up", check=False)
