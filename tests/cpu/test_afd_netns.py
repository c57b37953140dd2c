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


@pytest.fixture(scope="module")
def netns():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (os.geteuid() != 0)")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is not installed")
    rng = random.Random()
    tag = f"{os.getpid() % 1000:03d}{rng.randrange(1000):03d}"
    x, y = rng.randrange(100, 250), rng.randrange(1, 250)
    ns = NetNS(a=f"afdA{tag}", b=f"afdB{tag}", veth_a=f"afva{tag}", veth_b=f"afvb{tag}",
               addr_a=f"10.{x}.{y}.1", addr_b=f"10.{x}.{y}.2")  # fmt: skip
    made: list[str] = []
    try:
        r = _ip("netns", "add", ns.a, check=False)
        if r.returncode != 0:
            pytest.skip(f"`ip netns add` failed: {r.stderr.strip()}")
        made.append(ns.a)
        _ip("netns", "add", ns.b)
        made.append(ns.b)
        _ip("link", "add", ns.veth_a, "type", "veth", "peer", "name", ns.veth_b)
        _ip("link", "set", ns.veth_a, "netns", ns.a)
        _ip("link", "set", ns.veth_b, "netns", ns.b)
        for name, dev, addr in ((ns.a, ns.veth_a, ns.addr_a), (ns.b, ns.veth_b, ns.addr_b)):
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", dev, "up")
        print(f"namespaces {ns.a} ({ns.addr_a}) <-> {ns.b} ({ns.addr_b})")
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
            _ip("netns", "del", name, check=False)
        left = _ip("netns", "list", check=False).stdout
        assert ns.a not in left and ns.b not in left, left
        links = _ip("link", "show", check=False).stdout
        assert ns.veth_a not in links and ns.veth_b not in links


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
    port = su.free_port()
    (tmp_path / "prompts.json").write_text(json.dumps(SPEC))
    ffn = AfdProc("ffn", model_dir, tmp_path / "ffn.log",
                  ["--afd", afd("ffn", netns.addr_b, port, 120)], netns=netns.b)
    procs.append(ffn)
    attn = AfdProc("attention", model_dir, tmp_path / "attn.log",
                   ["--afd", afd("attention", netns.addr_b, port, 120),
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
    assert ffn.p.poll() is None, "the FFN must keep serving after the attention goodbye"
    # it binds only the configured address: nothing listens on its namespace's loopback
    assert _connect_from(netns.b, "127.0.0.1", port) == "ConnectionRefusedError"
    assert _connect_from(netns.a, netns.addr_b, port) == "open"  # while on the veth it is
    print(f"AFD across namespaces: tokens identical, max |logprob diff| {worst:.2e}, "
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
    """The FFN rank (namespace B, its veth address) is SIGKILLed while the attention rank
    (namespace A) generates, and started again 2 s after it is gone: the attention rank holds
    its step, rejoins it across the link and finishes with plain vLLM's tokens."""
    port = su.free_port()
    (tmp_path / "prompts.json").write_text(json.dumps(SPEC_LONG))

    def start_ffn(n: int) -> AfdProc:
        ffn = AfdProc("ffn", model_dir, tmp_path / f"ffn{n}.log",
                      ["--afd", afd("ffn", netns.addr_b, port, 60)], netns=netns.b)
        procs.append(ffn)
        return ffn

    ffn = start_ffn(1)
    attn = AfdProc("attention", model_dir, tmp_path / "attn.log",
                   ["--afd", afd("attention", netns.addr_b, port, 60, rejoin_timeout_s=300),
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
