"""Listen ports for the servers the tests, the demo and the benchmarks start, and the
internal port base of each engine (``VLLM_PORT``)."""

from __future__ import annotations

import os
import random
import socket

# Ports handed out for servers to listen on lie in a window below the kernel's ephemeral
# range: a port the kernel can pick by itself (an outgoing connection's source port, any
# program's bind(0), such as vLLM's internal ports or torch.distributed's store) may be
# taken between the moment it is handed out and the moment the server binds it: the
# server then fails with EADDRINUSE, or a client (the AFD attention rank retrying while
# its FFN rank starts) connects to itself or to that other listener. The window starts
# above the VLLM_PORT bases of internal_port_base (20000-29900; vLLM scans a few ports
# upward from its base).
LISTEN_WINDOW_START = 30100
# Two processes that hand out ports at once (`make test` runs tests/unit beside tests/cpu)
# each take a part of the window of their own: "LO-HI" (LO included, HI not). Neither then
# hands out a port the other has handed out and its server has not bound yet.
PORT_WINDOW_ENV = "AFD_PORT_WINDOW"
_HANDED_OUT: set[int] = set()


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (the Linux default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable_now(port: int, host: str) -> bool:
    # Without SO_REUSEADDR: a port with a connection in TIME_WAIT is skipped too.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listen_window() -> tuple[int, int]:
    """The ports free_ports hands out, ``[lo, hi)``: from LISTEN_WINDOW_START up to the
    kernel's ephemeral range, narrowed to the part ``$AFD_PORT_WINDOW`` ("LO-HI") names."""
    lo, hi = LISTEN_WINDOW_START, ephemeral_port_range()[0]
    spec = os.environ.get(PORT_WINDOW_ENV, "").strip()
    if spec:
        try:
            part_lo, part_hi = (int(v) for v in spec.split("-"))
        except ValueError:
            raise ValueError(f"{PORT_WINDOW_ENV}={spec!r}: expected LO-HI, e.g. 30100-31500") from None
        lo, hi = max(lo, part_lo), min(hi, part_hi)
    return lo, hi


def free_ports(n: int = 1, host: str = "127.0.0.1", *, consecutive: bool = False) -> list[int]:
    """``n`` distinct TCP ports, free now, below the ephemeral range, none handed out
    before by this process (two servers started one after the other never get the same
    port, even while the first has not bound its port yet). With ``consecutive``, ``n``
    consecutive ports (an M:N FFN deployment listens on ``port + rank``). Where the
    ephemeral range leaves no room below it, the kernel's ``bind(0)`` picks them."""
    if n < 1:
        raise ValueError(f"free_ports: n must be >= 1, got {n}")
    lo, hi = listen_window()
    if hi - lo < 8 * n:
        return _kernel_ports(n, host, consecutive)
    if len(_HANDED_OUT) > (hi - lo) // 2:
        _HANDED_OUT.clear()  # a long-lived process: the servers of the oldest ports are gone
    rng = random.SystemRandom()
    for _ in range(500):
        if consecutive:
            base = rng.randrange(lo, hi - n + 1)
            ports = list(range(base, base + n))
        else:
            ports = rng.sample(range(lo, hi), n)
        if any(p in _HANDED_OUT for p in ports):
            continue
        if all(_bindable_now(p, host) for p in ports):
            _HANDED_OUT.update(ports)
            return ports
    raise RuntimeError(f"no {n} free port(s) on {host} in {lo}-{hi - 1}")


def _kernel_ports(n: int, host: str, consecutive: bool) -> list[int]:
    for _ in range(100):
        socks: list[socket.socket] = []
        try:
            for _ in range(1 if consecutive else n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, 0))
            ports = [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
        if consecutive:
            ports = list(range(ports[0], ports[0] + n))
            if ports[-1] > 65535 or not all(_bindable_now(p, host) for p in ports[1:]):
                continue
        return ports
    raise RuntimeError(f"no {n} free port(s) on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


_PORT_BASES: list[int] = []  # the bases handed out last, oldest first


def internal_port_base() -> int:
    """A ``VLLM_PORT`` for one server: where vLLM scans upward for its internal ports
    (torch.distributed, ZMQ). Without it vLLM takes ephemeral ports it checked a moment
    earlier, and a concurrent client connection can take the same port in between
    (EADDRINUSE at ``init_process_group``). Bases lie below the ephemeral range, 100
    apart; a base is not handed out again while it is among the last 50 handed out, so
    servers started close together never share one (vLLM checks a port is free before
    it binds it, but a multi-process server binds its store seconds after that check)."""
    bases = range(20000, 30000, 100)
    base = random.SystemRandom().choice([b for b in bases if b not in _PORT_BASES])
    _PORT_BASES.append(base)
    del _PORT_BASES[:-50]
    return base


def port_bindable(port: int, host: str = "127.0.0.1") -> bool:
    """True when a new server could listen on ``host:port`` now. SO_REUSEADDR is set, as
    uvicorn and the AFD FFN listener set it: closed connections in TIME_WAIT do not count,
    a socket still bound or listening there does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
    return True
