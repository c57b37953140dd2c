"""cuda_ipc connector pieces that need no GPU: inbox sizing and bounds, the
buffer descriptions it exchanges, and its refusal to run off CUDA. The device
path itself runs in tests/gpu/test_gpu_ipc_connector.py."""

from __future__ import annotations

import pytest
import torch

from vllm.afd.protocol import AFDProtocolError, parse_hello
from vllm.config.afd import AFDConfig
from vllm.distributed.afd import cuda_ipc as ipc
from vllm.distributed.afd.base import (
    ConnectorContext,
    create_attention_connector,
    create_ffn_connector,
)


def _ctx(role="ffn", gate=False, logits=None, device="cpu", tokens=64):
    cfg = AFDConfig.from_dict(
        {"role": role, "connector": "cuda_ipc", "compute_gate_on_attention": gate}
    )
    fp = {"hidden_size": 100, "dtype": "bfloat16"}
    return ConnectorContext(cfg, 0, fp, tokens, torch.device(device), num_router_logits=logits)


def test_registered_under_its_name_and_alias():
    for name in ("cuda_ipc", "ipc"):
        cfg = AFDConfig.from_dict({"role": "ffn", "connector": name})
        ctx = ConnectorContext(cfg, 0, {}, 8, torch.device("cpu"))
        assert isinstance(create_ffn_connector(ctx), ipc.IPCFFNConnector)
        ctx.config = AFDConfig.from_dict({"role": "attention", "connector": name})
        assert isinstance(create_attention_connector(ctx), ipc.IPCAttentionConnector)
    assert ipc.IPCAttentionConnector.graph_capable and ipc.IPCFFNConnector.graph_capable


def test_graph_and_dbo_capability_agree_with_the_spec_records():
    from vllm.afd.connector_spec import SPECS, resolve
    from vllm.distributed.afd import base, tcp

    def attention_of(name):
        return base.connector_classes(name)[0]

    assert {"gloo", "nccl", "cuda_ipc"} <= set(base.connector_names())
    for name in base.connector_names():
        attention, ffn = base.connector_classes(name)
        assert attention.graph_capable == SPECS[name].graph_capable, name
        assert ffn.graph_capable == SPECS[name].ffn_graph_capable, name
        for cls in (attention, ffn):
            assert cls.dbo_capable == SPECS[name].dbo_capable, (name, cls)
    # nixl: graphs on the attention side only (the FFN host loop takes part in each hand-over)
    assert SPECS["nixl"].graph_capable and not SPECS["nixl"].ffn_graph_capable
    # classes that disagree with the record they register under are refused
    with pytest.raises(ValueError, match=r"graph_capable=True but its spec record .* says False"):
        base.register_connector("gloo", ipc.IPCAttentionConnector, ipc.IPCFFNConnector)
    with pytest.raises(ValueError, match=r"dbo_capable=True but its spec record .* says False"):
        base.register_connector("nccl", attention_of("nccl"), ipc.IPCFFNConnector)
    with pytest.raises(ValueError, match=r"graph_capable=False but its spec record .* says True"):
        base.register_connector("nccl", tcp.TCPAttentionConnector, tcp.TCPFFNConnector)
    with pytest.raises(ValueError, match="unknown connector 'not_listed'"):
        base.register_connector("not_listed", ipc.IPCAttentionConnector, ipc.IPCFFNConnector)
    assert base.connector_classes("gloo")[0] is tcp.TCPAttentionConnector
    assert resolve("TCP") is SPECS["gloo"]


def test_inbox_holds_hidden_states_and_router_logits_of_the_largest_step():
    plain = ipc.message_bytes(_ctx())
    assert plain >= 64 * 100 * 2 and plain % ipc.ALIGN == 0
    gated = ipc.message_bytes(_ctx(gate=True, logits=60))
    assert gated >= 64 * (100 * 2 + 60 * 4)
    # Both messages of one gated layer fit, each at an aligned offset.
    assert ipc._align(64 * 100 * 2) + 64 * 60 * 4 <= gated


def test_view_refuses_a_message_past_the_inbox():
    buf = torch.zeros(1024, dtype=torch.uint8)
    x = torch.ones((4, 64), dtype=torch.bfloat16)  # 512 bytes
    v = ipc._view(buf, 512, x)
    assert v.shape == x.shape and v.dtype == x.dtype
    with pytest.raises(AFDProtocolError, match="exceeds the inbox"):
        ipc._view(buf, 768, x)


def test_buffer_descriptions_travel_as_flat_scalar_hellos():
    desc = {"a": {"handle": "00ff", "numel": 3}, "status": "ok", "row": 1}
    flat = ipc._flat(desc)
    assert parse_hello(__import__("json").dumps(flat).encode()) == flat  # scalars only
    assert ipc._sub(flat, "a") == {"handle": "00ff", "numel": 3}
    with pytest.raises(AFDProtocolError, match="bad CUDA IPC description of the peer's inbox"):
        ipc.import_buffer({"handle": "zz"}, 64, "inbox")


@pytest.mark.parametrize("role", ["ffn", "attention"])
def test_refuses_a_cpu_device(role):
    ctx = _ctx(role=role)
    if role == "ffn":
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            create_ffn_connector(ctx).start()
    else:
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            create_attention_connector(ctx)._setup_device()


def test_view_keeps_a_message_inside_its_micro_batch_slot():
    buf = torch.zeros(1024, dtype=torch.uint8)
    x = torch.ones((2, 64), dtype=torch.bfloat16)  # 256 bytes
    buf[512:768] = 7
    v = ipc._view(buf, 0, x, 1, 512)  # slot 1 starts at byte 512
    assert v.view(torch.uint8).eq(7).all()
    assert ipc._view(buf, 256, x, 0, 512).data_ptr() == buf[256:].data_ptr()
    with pytest.raises(AFDProtocolError, match=r"exceeds the inbox \(512 bytes\)"):
        ipc._view(buf, 384, x, 0, 512)  # would spill into slot 1


def test_ffn_side_answers_later_micro_batches_from_the_announced_counts():
    from vllm.afd.protocol import MSG_STEP, AFDPeerError, Control, ubatch_flags, ubatch_of
    from vllm.distributed.afd.base import StepPeer

    conn = create_ffn_connector(_ctx())
    assert conn.ubatch_controls_upfront and ipc.SLOTS == 2
    ctrl = torch.zeros((ipc.CTRL_ROWS, ipc.ROW), dtype=torch.int64)
    box = conn.inboxes[0] = ipc._Inbox(0, ctrl, torch.zeros(8, dtype=torch.uint8), {})
    box.ub_tokens, box.next_ub = [3, 2], 1  # as _device_ready leaves them
    first = StepPeer(0, Control(MSG_STEP, 5, 3, ubatch_flags(0, 2)))
    second = conn.recv_control(first)
    assert (second.type, second.step_id, second.num_tokens) == (MSG_STEP, 5, 2)
    assert ubatch_of(second.flags) == (1, 2)
    with pytest.raises(AFDPeerError, match="micro-batch 2 asked for, step 5 .* has 2"):
        conn.recv_control(first)


def test_watchdog_skips_the_device_probe_during_graph_captures():
    """vLLM captures in CUDA's global mode: the watchdog's synchronising read of the
    error word would make the capture fail (seen at DeepSeek-V2-Lite shapes on an
    H200), so it only checks the socket meanwhile."""
    import socket

    from vllm.afd import roles

    conn = create_attention_connector(_ctx(role="attention"))
    conn.sock, other = socket.socketpair()
    reads = []

    def read():
        reads.append(roles._captures)
        return 5

    conn._read_error_word = read
    try:
        with roles.graph_capture_guard():
            assert conn._probe() is None and reads == []
            assert roles.unless_capturing(lambda: 1) is None
        assert "did not answer within the timeout" in conn._probe()
        assert "layer message 5" in conn._probe() and reads == [0, 0]
        other.close()  # a closed peer is still seen during a capture
        with roles.graph_capture_guard():
            assert "connection closed" in conn._probe()
    finally:
        conn.sock.close()


def test_every_graph_capture_of_the_worker_runs_inside_the_guard():
    """Patch graph-capture-guard: the GPU worker captures CUDA graphs at two sites, capture_model and
    the CUDA graph memory profiling of determine_available_memory
    (profile_cudagraph_memory); each runs inside graph_capture_guard, or the watchdog's
    device read can invalidate that capture (seen on an H200 at the profiling site).
    Read from the installed vLLM's source: the worker imports CUDA-only modules."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    path = Path(spec.origin).parent / "v1" / "worker" / "gpu_worker.py"
    tree = ast.parse(path.read_text())
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def guarded(node) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.With) and any(
                isinstance(i.context_expr, ast.Call)
                and getattr(i.context_expr.func, "id", None) == "graph_capture_guard"
                for i in node.items
            ):
                return True
        return False

    sites = [
        n for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and n.func.attr in ("capture_model", "profile_cudagraph_memory")
        and ast.unparse(n.func.value) == "self.model_runner"
    ]  # fmt: skip
    assert sorted({s.func.attr for s in sites}) == ["capture_model", "profile_cudagraph_memory"]
    unguarded = [f"line {s.lineno}: {ast.unparse(s)}" for s in sites if not guarded(s)]
    assert not unguarded, f"{path}: captures outside graph_capture_guard: {unguarded}"


# ------------------------------------------------- the watchdog's socket probe
@pytest.fixture
def high_fd_pair():
    """A connected socket pair whose first socket has a descriptor >= 1024 (select()
    refuses those; vLLM raises the file limit, so a process with ~1000 other files and
    connections gets one). The soft file limit is raised for the test if needed."""
    import os
    import resource
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1500
    if soft <= want:
        assert hard == resource.RLIM_INFINITY or hard > want, f"hard file limit {hard}"
        resource.setrlimit(resource.RLIMIT_NOFILE, (want + 1, hard))
    a, b = socket.socketpair()
    fd = os.dup2(a.fileno(), want)
    a.close()
    high = socket.socket(fileno=fd)
    high.settimeout(5.0)  # as the connector's socket (a timeout makes recv poll first)
    try:
        assert high.fileno() >= 1024
        yield high, b
    finally:
        high.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_socket_probe_works_for_a_descriptor_above_1024(high_fd_pair):
    """The probe used select() once, whose ValueError for a descriptor
    >= 1024 ended the watchdog thread: a lost FFN rank was never noticed."""
    high, other = high_fd_pair
    assert ipc.socket_lost(high) is None  # open, nothing to read; returns at once
    other.send(b"x")
    assert ipc.socket_lost(high) is None  # data waiting: still open, nothing consumed
    assert high.recv(1) == b"x"
    other.close()
    assert ipc.socket_lost(high) == "connection closed"


def test_socket_probe_reports_a_reset():
    import socket
    import struct
    import time

    # A reset (RST) needs TCP: a connection over the loopback.
    lst = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(lst.getsockname())
    srv, _ = lst.accept()
    lst.close()
    try:
        cli.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        cli.close()
        deadline = time.monotonic() + 5
        while (lost := ipc.socket_lost(srv)) is None:
            assert time.monotonic() < deadline, "no reset seen"
        assert "reset" in lost.lower(), lost
    finally:
        srv.close()


def test_attention_probe_of_a_socket_above_1024(high_fd_pair):
    conn = create_attention_connector(_ctx(role="attention"))
    conn._read_error_word = lambda: 0
    high, other = high_fd_pair
    conn.sock = high
    assert conn._probe() is None
    other.close()
    assert conn._probe() == f"lost AFD peer {conn.peer}: connection closed"


def test_a_failing_probe_fails_the_rank_with_a_named_error(monkeypatch):
    """Never silently: an exception of the probe used to end the watchdog thread
    without a word, and nothing watched the FFN rank any more."""
    import threading

    from vllm.afd import failure

    conn = create_attention_connector(_ctx(role="attention"))
    recorded, failed = [], threading.Event()
    monkeypatch.setattr(failure, "record", lambda *a: recorded.append(a))

    def probe():
        raise ValueError("filedescriptor out of range in select()")

    conn._probe = probe
    conn.on_failure = lambda msg: (recorded.append(msg), failed.set())
    watch = threading.Thread(target=conn._watchdog, daemon=True)
    watch.start()
    assert failed.wait(5), "the watchdog reported nothing"
    watch.join(5)
    msg = recorded[-1]
    assert not watch.is_alive() and conn._dead == msg
    assert msg.startswith(f"AFD watchdog of the connection to {conn.peer} failed (ValueError:")
    assert recorded[0] == ("attention", 0, msg)


def test_the_ffn_host_polls_back_to_back_while_steps_flow():
    conn = create_ffn_connector(_ctx())
    assert conn.hot_poll and conn._poll_pause(0.0) == conn.IDLE_POLL_S  # no step yet
    conn._last_step = 100.0
    assert conn._poll_pause(100.0 + conn.HOT_S / 2) == 0.0
    assert conn._poll_pause(100.0 + conn.HOT_S * 2) == conn.IDLE_POLL_S
    cfg = AFDConfig.from_dict({"role": "ffn", "connector": "cuda_ipc",
                               "connector_extra_config": {"ffn_hot_poll": False}})  # fmt: skip
    off = create_ffn_connector(ConnectorContext(cfg, 0, {}, 8, torch.device("cpu")))
    off._last_step = 100.0
    assert off._poll_pause(100.0) == 20e-6  # the earlier fixed 20 us
