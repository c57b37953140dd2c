"""Cost of one cuda_ipc hand-over between two processes, with nothing else running.

Two processes (an "attention" side and an "FFN" side, like AFD's two roles) exchange a
[tokens, hidden] message back and forth ``--layers`` times a step, both sides replaying
one CUDA graph per step: ``split``, the connector's way (overlay/vllm/distributed/afd/
ipc_kernels.py, loaded from this tree: a torch copy plus a signal kernel to send, a wait
kernel plus a torch copy to receive), and ``fused``, an experiment kept here (one kernel per
side: the sender's programs copy and the last one signals; the receiver's programs wait,
copy, and the last one advances the counter; their signal and wait are the connector's
device bodies ``signal_at`` and ``spin_wait``). Measured on an H200 under MPS the fused one is
slower (docs/benchmarks.md), so the connector keeps the split one. The FFN side only echoes the
message, so the step time is the hand-overs alone: ``us per hand-over = step / (2 x
layers)``. Both processes on one GPU (under CUDA MPS with ``--mps``; without it they
time-slice the GPU) or on two (``--peer-gpu``).

    python3 benchmarks/handover.py --mps --tokens 16,64,256 --hidden 2048 --layers 27

``--variants split,nixl,nixl-host`` (``--connector nixl`` adds both) measures the nixl
connector's device path beside it, with its own classes (the installed vLLM's
``vllm.distributed.afd.nixl``; ``nixl`` installed): ``nixl``, the attention side's graph of
copy + record kernels and bounded waits that its host proxy thread posts as NIXL writes,
against the FFN side's host loop (wait for the notification, copy out, copy in, write
back); ``nixl-host``, the same NIXL writes and host loop on both sides with no kernel and
no proxy (each side's host posts and waits): the floor of NIXL and the host loops, so that
``nixl`` minus ``nixl-host`` is what the proxy and the device waits add. A second table
says where a ``nixl`` hand-over goes, from its proxy's own timings (breakdown_table).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import mps

KERNELS = Path(__file__).resolve().parents[1] / "overlay/vllm/distributed/afd/ipc_kernels.py"
TIMEOUT_NS = 10 * 10**9


FUSED_BLOCK = 2048  # int32 words each program of a fused kernel copies


def load_kernels():
    """The connector's kernels module, loaded from this tree (not the installed wheel)."""
    spec = importlib.util.spec_from_file_location("afd_ipc_kernels", KERNELS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


try:  # the GPU host's torch ships triton; elsewhere only --help and the parser work
    import torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    IPC = load_kernels()
    # The fused experiment has no counterpart in ipc_kernels.py, so its two kernels live
    # here; their signal and wait are the connector's own device bodies, not a copy.
    signal_at, spin_wait = IPC.signal_at, IPC.spin_wait

    @triton.jit(do_not_specialize=["n_words"])
    def _send_fused_kernel(src_ptr, dst_ptr, n_words, ctr_ptr, flag_ptr, done_ptr,
                           BLOCK: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_words
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
        tl.debug_barrier()  # this program's stores, before it is counted
        prev = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="sys")
        if prev == tl.num_programs(0) - 1:  # the last program: every part is written
            tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
            signal_at(ctr_ptr, flag_ptr)

    @triton.jit(do_not_specialize=["n_words", "timeout_ns"])
    def _recv_fused_kernel(src_ptr, dst_ptr, n_words, ctr_ptr, flag_ptr, err_ptr, done_ptr,
                           timeout_ns, BLOCK: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        c = tl.load(ctr_ptr) + 1  # every program reads it before the last one advances it
        spin_wait(flag_ptr, c, err_ptr, timeout_ns)
        tl.debug_barrier()  # the other threads read after this program's acquire
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_words
        # .cg: from L2, never a line of an earlier message left in this SM's L1
        data = tl.load(src_ptr + offs, mask=mask, cache_modifier=".cg")
        tl.store(dst_ptr + offs, data, mask=mask)
        tl.debug_barrier()
        prev = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
        if prev == tl.num_programs(0) - 1:
            tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
            tl.store(ctr_ptr, c)


def kernels():
    """The connector's kernels (from this tree) plus the fused experiment."""
    IPC.send_fused, IPC.recv_fused = fused_kernels()
    return IPC


def fused_kernels():
    """(send_fused, recv_fused): one launch per side and hand-over."""

    def words(t):
        return t.reshape(-1).view(torch.int32)

    def grid(n: int) -> tuple[int]:
        return (max(1, triton.cdiv(n, FUSED_BLOCK)),)

    def send_fused(src, dst, ctr, flag, done) -> None:
        s, d = words(src), words(dst)
        _send_fused_kernel[grid(s.numel())](s, d, s.numel(), ctr, flag, done, BLOCK=FUSED_BLOCK)

    def recv_fused(src, dst, ctr, flag, err, done, timeout_ns) -> None:
        s, d = words(src), words(dst)
        _recv_fused_kernel[grid(s.numel())](s, d, s.numel(), ctr, flag, err, done, timeout_ns,
                                            BLOCK=FUSED_BLOCK)  # fmt: skip

    return send_fused, recv_fused


class Side:
    """One side's buffers: its inbox and flag (mapped by the peer), counters, scratch."""

    def __init__(self, torch, max_bytes: int, device: str):
        self.inbox = torch.zeros(max_bytes, dtype=torch.uint8, device=device)
        self.flag = torch.zeros(8, dtype=torch.int64, device=device)  # [0]: data flag
        self.local = torch.zeros((5, 8), dtype=torch.int64, device=device)
        self.sent, self.recvd, self.err = self.local[0], self.local[1], self.local[2]
        self.done_send, self.done_recv = self.local[3], self.local[4]


def send(k, variant: str, me: Side, peer_inbox, peer_flag, x) -> None:
    n = x.numel() * x.element_size()
    dst = peer_inbox[:n].view(x.dtype).view(x.shape)
    if variant == "fused":
        k.send_fused(x, dst, me.sent, peer_flag, me.done_send)
    else:
        dst.copy_(x)
        k.signal(me.sent, peer_flag)


def recv(k, variant: str, me: Side, y) -> None:
    n = y.numel() * y.element_size()
    src = me.inbox[:n].view(y.dtype).view(y.shape)
    if variant == "fused":
        k.recv_fused(src, y, me.recvd, me.flag, me.err, me.done_recv, TIMEOUT_NS)
    else:
        k.wait(me.recvd, me.flag, me.err, TIMEOUT_NS)
        y.copy_(src)


def step(k, variant: str, role: str, me: Side, peer, x, y, layers: int) -> None:
    """One step's hand-overs. attention: send a layer's input, receive its output; FFN:
    the reverse (it echoes what it received), so that every hand-over is on the path."""
    peer_inbox, peer_flag = peer
    h = x
    for _ in range(layers):
        if role == "attention":
            send(k, variant, me, peer_inbox, peer_flag, h)
            recv(k, variant, me, y)
            h = y
        else:
            recv(k, variant, me, y)
            send(k, variant, me, peer_inbox, peer_flag, y)


def measure(torch, k, a, role: str, me: Side, peer, variant: str, tokens: int) -> dict:
    """Seconds per step of one variant and size (graph replays), and whether the
    attention side got its message back unchanged."""
    x = torch.randn((tokens, a.hidden), dtype=torch.bfloat16, device=me.inbox.device)
    y = torch.empty_like(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step(k, variant, role, me, peer, x, y, a.layers)  # compiles; pairs with the peer
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step(k, variant, role, me, peer, x, y, a.layers)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        graph.replay()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / a.steps
    return {"step_us": dt * 1e6, "echo_ok": bool(torch.equal(y, x)) or role != "attention",
            "err": int(me.err[0])}


def nixl_side(torch, role: str, a, q_out, q_in) -> dict:
    """Both nixl variants on this side (see the module docstring); the FFN side echoes."""
    from vllm.distributed.afd import nixl as nx
    from vllm.distributed.afd import nixl_device as nd

    dev = torch.device(torch.cuda.current_device())
    slot = max(a.tokens_list) * a.hidden * 2
    agent = nx.Agent(role, 0, "UCX", spin_s=1.0)  # spin: each side has cores of its own
    box = nx.Mailbox(agent, slot, dev)
    q_out.put((agent.metadata(), agent.name, box.address(), box.dev_id))
    meta, name, inbox, dev_id = q_in.get()
    peer = agent.add_peer(meta)
    assert peer == name, (peer, name)
    per_size = 1 + 3 + a.steps  # steps of each size: the warm-up, 3 replays, the timed ones
    out = {}
    for variant in [v for v in a.variants if v.startswith("nixl")]:
        # one session a variant; both directions carry its id (as the connector's do)
        s = nx.Session(variant, peer, (inbox, dev_id, "VRAM"), box, "peer")
        device_path = role == "attention" and variant == "nixl"
        if device_path:
            lanes = nd.DeviceLanes(nx.LANES, dev)
            losses: list[str] = []

            def write(lane, seq, nbytes, note, s=s):
                index = nx.slot_index(lane, seq)
                return agent.write(s.box.out_slot(index), s.peer_slot(index), max(1, nbytes),
                                   s.peer_agent, note, "peer")  # fmt: skip

            proxy = nd.Proxy(agent, lanes.records, lanes.controls, lanes.flags, nx.LANES, 1.0,
                             err=lanes.err, waited=lanes.waited)  # fmt: skip
            proxy.serve(nd.Target(variant, peer, write, None, losses.append), "peer")
        for tokens in a.tokens_list:
            x = torch.randn((tokens, a.hidden), dtype=torch.bfloat16, device=dev)
            y = torch.empty_like(x)
            if not device_path:  # the FFN side's host loop, or both sides' (nixl-host)
                t0 = time.perf_counter()
                for _ in range(per_size * a.layers):
                    if role == "attention":
                        nx.write_message(agent, s, 0, x, 30.0)
                    nx.read_message(agent, s, 0, nx.claim(s, 0), y, time.monotonic() + 30)
                    if role != "attention":
                        nx.write_message(agent, s, 0, y, 30.0)
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / per_size
                ok = bool(torch.equal(y, x)) or role != "attention"
                out[f"{variant}/{tokens}"] = {"step_us": dt * 1e6, "err": 0, "echo_ok": ok}
                continue

            def step(x=x, y=y, lanes=lanes):
                for _ in range(a.layers):
                    lanes.send(0, x, box.outbox, slot)
                    lanes.recv(0, y, box.inbox, slot, TIMEOUT_NS)

            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                step()
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                step()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            proxy.take_stats()  # the warm-up's
            t0 = time.perf_counter()
            for _ in range(a.steps):
                graph.replay()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / a.steps
            ok = bool(torch.equal(y, x)) and not losses
            out[f"{variant}/{tokens}"] = {"step_us": dt * 1e6, "err": lanes.error_word(),
                                          "echo_ok": ok,
                                          "proxy": proxy.take_stats().summary()}  # fmt: skip
        if device_path:
            proxy.stop()
    return out


def run_side(role: str, a, q_out, q_in, results) -> None:
    import torch

    if [v for v in a.variants if v.startswith("nixl")]:
        torch.cuda.set_device(f"cuda:{a.gpu if role == 'attention' else a.peer_gpu}")
        out = nixl_side(torch, role, a, q_out, q_in)
        a.variants = [v for v in a.variants if not v.startswith("nixl")]
    else:
        out = {}
    if not a.variants:
        results.put((role, out))
        q_in.get()
        return
    k = kernels()
    device = f"cuda:{a.gpu if role == 'attention' else a.peer_gpu}"
    torch.cuda.set_device(device)
    me = Side(torch, max(a.tokens_list) * a.hidden * 2, device)
    q_out.put((me.inbox, me.flag))
    peer = q_in.get()
    out.update({f"{v}/{t}": measure(torch, k, a, role, me, peer, v, t)
                for v in a.variants for t in a.tokens_list})
    results.put((role, out))
    q_in.get()  # the peer's buffers stay mapped until the other side is done too


def breakdown_table(proxied: dict[str, dict]) -> str:
    """Where a hand-over of the nixl device path goes (the proxy's own timings, medians):
    ``proxied`` maps "nixl/<tokens>" to its ProxyStats summary over the timed steps."""
    rows = ["nixl device path, medians in us: post (the proxy posts a write), poll (one round",
            "that took notifications), turn (write posted to the reply's notification: the FFN",
            "side's loop and both transfers), device wait (the graph's wait, on the GPU's clock),",
            "wait - turn (of the same last writes: the proxy's wake-up on the record, its",
            "post, the flag's way back)",
            "tokens     post     poll     turn     wait   wait-turn   writes"]
    for key, m in proxied.items():
        rows.append(f"{int(key.split('/')[1]):6d} {m['post_us']:8.1f} {m['poll_us']:8.1f} "
                    f"{m['turn_us']:8.1f} {m['wait_us']:8.1f} "
                    f"{m['wait_us'] - m['turn_waited_us']:11.1f} "
                    f"{m['posts']:8.0f}")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="16,64,256")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--variants", default="split,fused",
                   help="split, fused, nixl, nixl-host (comma-separated)")
    p.add_argument("--connector", choices=["cuda_ipc", "nixl"],
                   help="nixl: add the nixl variants to --variants")
    p.add_argument("--gpu", default="0")
    p.add_argument("--peer-gpu", default="0")
    p.add_argument("--mps", action="store_true", help="start the CUDA MPS control daemon")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    a.tokens_list = [int(t) for t in a.tokens.split(",")]
    a.variants = [v for v in a.variants.split(",") if v]
    if a.connector == "nixl":
        a.variants += [v for v in ("nixl", "nixl-host") if v not in a.variants]
    if set(a.variants) - {"split", "fused", "nixl", "nixl-host"}:
        p.error("--variants: split, fused, nixl, nixl-host")
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    with mps.daemon(a.mps) as env:
        os.environ.update(env)
        q1, q2, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=run_side, args=("attention", a, q1, q2, results)),
                 ctx.Process(target=run_side, args=("ffn", a, q2, q1, results))]
        for proc in procs:
            proc.start()
        got = dict(results.get(timeout=600) for _ in procs)
        q1.put(None)
        q2.put(None)
        for proc in procs:
            proc.join(60)
    sharing = "one GPU, MPS" if a.mps else (
        "one GPU, time-sliced" if a.gpu == a.peer_gpu else "two GPUs")
    print(f"hand-over cost ({sharing}; hidden {a.hidden}, bf16, {a.layers} layers = "
          f"{2 * a.layers} hand-overs a step, CUDA graphs both sides)")
    print("variant  tokens   step us   us per hand-over   echo")
    bad = 0
    for key, r in got["attention"].items():
        variant, tokens = key.split("/")
        per = r["step_us"] / (2 * a.layers)
        ok = r["echo_ok"] and not r["err"]
        bad += not ok
        print(f"{variant:7s} {int(tokens):7d} {r['step_us']:9.1f} {per:18.2f}   "
              f"{'ok' if ok else 'WRONG'}")
    proxied = {k: r["proxy"] for k, r in got["attention"].items() if "proxy" in r}
    if proxied:
        print(breakdown_table(proxied))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": {k: v for k, v in vars(a).items()},
                                            "sharing": sharing, "results": got}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
