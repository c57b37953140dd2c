# SPDX-License-Identifier: Apache-2.0
"""What runs inside the Ray cluster: one :class:`ServerActor` per ``vllm serve`` process
and one :class:`Supervisor` that keeps the deployment's state (docs/deployment.md).

Standard library only at module level, and nothing of vLLM: the launcher ships this module
to the cluster by value (cloudpickle), so the actors' worker processes import neither vLLM
nor torch. ``ray`` is imported inside the methods that run in the cluster.

Moved FFN ranks: an attention rank reaches FFN rank f through a **relay** in its own actor
(a local listener on 127.0.0.1 per FFN rank, its ``ffn_addresses`` entry), which dials the
FFN rank's current address for every new connection. When the supervisor starts a lost FFN
rank on another node it points the relays there; the attention ranks' rejoin (they hold
the interrupted step for ``rejoin_timeout_s``) dials the relay again and reaches the new
server. The address in the attention ranks' configuration never changes, no DNS is needed.
Connectors without a TCP rejoin (cuda_ipc) get the FFN addresses directly; their
attention ranks end with a lost FFN rank and are started again with the new addresses.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

PR_SET_PDEATHSIG = 1


def serve_argv(python: str, model: str, bind: str, http_port: int, afd_config: dict[str, Any],
               args: list[str]) -> list[str]:  # fmt: skip
    """The argv of one ``vllm serve`` of the deployment."""
    return [python, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", bind,
            "--port", str(http_port), "--afd-config", json.dumps(afd_config, sort_keys=True),
            *args]  # fmt: skip


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------- relay
class Relay:
    """A local TCP listener that forwards each connection to ``target()`` (host, port),
    looked up again for every connection; a connection is held while the target does not
    answer, up to ``wait_s``. When either side closes or fails, both are closed (the AFD
    channel has no half-closed state: the peer then sees EOF and rejoins or drops the rank)."""

    BUF = 1 << 20

    def __init__(self, target, wait_s: float, host: str = "127.0.0.1"):
        self.target = target
        self.wait_s = wait_s
        self.sock = socket.create_server((host, 0))
        self.address = join_address(host, self.sock.getsockname()[1])
        self.connections = 0
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="afd-relay", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.1)
                continue
            threading.Thread(target=self._serve, args=(down,), daemon=True).start()

    def _dial(self) -> socket.socket | None:
        deadline = time.monotonic() + self.wait_s
        while not self._closed:
            host, port = self.target()
            try:
                return socket.create_connection((host, port), timeout=2.0)
            except OSError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.2)
        return None

    def _serve(self, down: socket.socket) -> None:
        up = self._dial()
        if up is None:
            down.close()
            return
        pair = (down, up)
        for s in pair:
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._open.update(pair)
            self.connections += 1
        threading.Thread(target=self._pump, args=(up, down, pair), daemon=True).start()
        self._pump(down, up, pair)

    def _pump(self, src: socket.socket, dst: socket.socket, pair) -> None:
        buf = memoryview(bytearray(self.BUF))
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                dst.sendall(buf[:n])
        except OSError:
            pass
        for s in pair:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        with self._lock:
            self._open.difference_update(pair)

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        with self._lock:
            held = list(self._open)
        for s in held:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


# ---------------------------------------------------------------- one server
def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the actor process dies."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def http_get(url: str, timeout: float = 3.0) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (OSError, ValueError):
        return None, ""


class ServerActor:
    """One ``vllm serve`` process (its own session, SIGKILLed with the actor) and, on an
    attention slot, its relays to the FFN ranks."""

    def __init__(self, name: str):
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.relays: list[Relay] = []
        self.targets: list[tuple[str, int]] = []
        self.url: str | None = None
        self.log_path: str | None = None

    def node(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "pid": os.getpid(), "python": sys.executable}  # fmt: skip

    def open_relays(self, targets: list[str], wait_s: float) -> list[str]:
        """One relay per FFN rank; returns their addresses (the attention rank's
        ffn_addresses)."""
        self.set_targets(targets)
        self.relays = [Relay(lambda f=f: self.targets[f], wait_s) for f in range(len(targets))]
        return [r.address for r in self.relays]

    def set_targets(self, targets: list[str]) -> None:
        self.targets = [split_address(t) for t in targets]

    def relay_connections(self) -> list[int]:
        return [r.connections for r in self.relays]

    def start(self, argv: list[str], env: dict[str, str], log_path: str, url: str) -> int:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        self.url, self.log_path = url, log_path
        with open(log_path, "ab") as log:
            log.write(("$ " + " ".join(argv) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env={**os.environ, **env},
                                         start_new_session=True,
                                         preexec_fn=_die_with_parent)  # fmt: skip
        return self.proc.pid

    def poll(self) -> int | None:
        """The server's exit code, None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def health(self) -> int | None:
        return http_get(f"{self.url}/health")[0]

    def load(self) -> float | None:
        """Requests running or waiting (vllm:num_requests_*), None when /metrics fails."""
        status, text = http_get(f"{self.url}/metrics")
        if status != 200:
            return None
        total = 0.0
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM to the server's process group, SIGKILL to what is left after ``grace``;
        then the relays close: what the server sends as it exits (an attention rank's
        goodbye, which lets the FFN rank drop it without counting a loss) still passes."""
        try:
            return self._stop_server(grace)
        finally:
            for r in self.relays:
                r.close()

    def _stop_server(self, grace: float) -> int | None:
        if self.proc is None:
            return None
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        while _group_members(pgid) and time.monotonic() < deadline + 10:
            time.sleep(0.1)
        return self.proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except (OSError, TypeError):
            return ""


# ---------------------------------------------------------------- the supervisor
class Slot:
    """The supervisor's record of one server (an attention slot or an FFN server)."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.name: str = spec["name"]
        self.role: str = spec["role"]
        self.actor = None
        self.gen = 0
        self.node: dict[str, Any] = {}
        self.state = "stopped"  # stopped|starting|healthy|unhealthy|draining|lost
        self.restarts = 0
        self.started_at: float | None = None
        self.healthy_at: float | None = None
        self.unhealthy_at: float | None = None
        self.missed = 0
        self.error = ""

    @property
    def active(self) -> bool:
        return self.state in ("starting", "healthy", "unhealthy", "lost")


class Supervisor:
    """Starts the servers, watches them and starts a lost one again, scales the attention
    slots, stops everything. ``plan``: what the launcher derived from the topology (see
    ray_launcher.plan): the servers' specs, the initial slots, the Ray options."""

    def __init__(self, plan: dict[str, Any]):
        self.plan = plan
        self.slots = {s["name"]: Slot(s) for s in plan["servers"]}
        self.events: list[dict[str, Any]] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.log_path = os.path.join(plan["log_dir"], "supervisor.log")
        os.makedirs(plan["log_dir"], exist_ok=True)

    # -- records --------------------------------------------------------
    def _event(self, what: str, **info: Any) -> None:
        rec = {"t": time.time(), "what": what, **info}
        with self._lock:
            self.events.append(rec)
        with open(self.log_path, "a") as f:
            f.write(time.strftime("%Y-%m-%d %H:%M:%S ") + what + " "
                    + json.dumps(info, sort_keys=True) + "\n")  # fmt: skip

    def ping(self) -> bool:
        return True

    # -- placement ------------------------------------------------------
    def _ffn_slots(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.role == "ffn"]

    def ffn_addresses(self) -> list[str]:
        """Where each FFN rank listens now (its server's node and port)."""
        out = [""] * self.plan["num_ffn_ranks"]
        for s in self._ffn_slots():
            for f in s.spec["ffn_ranks"]:
                out[f] = join_address(s.node.get("ip", "127.0.0.1"), self.plan["afd_ports"][f])
        return out

    def _new_actor(self, slot: Slot):
        import ray

        from_actor = ray.remote(ServerActor)
        res = slot.spec["resources"]
        opts: dict[str, Any] = dict(
            name=f"{slot.name}-g{slot.gen}", namespace=self.plan["namespace"],
            lifetime="detached", max_restarts=0, max_concurrency=8,
            num_cpus=res["cpus"], num_gpus=res["gpus"], resources=res["ray_resources"] or None,
        )  # fmt: skip
        if self.plan.get("placement_group") is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            pg = ray.util.get_placement_group(self.plan["placement_group"])
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg)
        return from_actor.options(**opts).remote(slot.name)

    def _start(self, slot: Slot, why: str) -> bool:
        """Place ``slot``'s actor and start its server; False when it could not be placed
        within the placement timeout (the monitor tries again)."""
        import ray

        slot.gen += 1
        actor = self._new_actor(slot)
        try:
            node = ray.get(actor.node.remote(), timeout=self.plan["place_timeout_s"])
        except Exception as e:  # noqa: BLE001 - no node with its resources yet
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            slot.state, slot.error = "lost", f"not placed: {type(e).__name__}"
            return False
        spec = slot.spec
        ip = node["ip"]
        afd = dict(spec["afd_config"])
        afd["host"] = ip
        addresses = self.ffn_addresses()
        if slot.role == "attention" and self.plan["relayed"]:
            addresses = ray.get(actor.open_relays.remote(addresses, self.plan["relay_wait_s"]))
        afd["ffn_addresses"] = addresses
        argv = serve_argv(node["python"], self.plan["model"], ip, spec["http_port"], afd,
                          spec["args"])  # fmt: skip
        log = os.path.join(self.plan["log_dir"], f"{slot.name}-g{slot.gen}.log")
        url = f"http://{join_address(ip, spec['http_port'])}"
        ray.get(actor.start.remote(argv, spec["env"], log, url))
        with self._lock:
            slot.actor, slot.node, slot.state = actor, node, "starting"
            slot.started_at, slot.healthy_at, slot.missed, slot.error = time.time(), None, 0, ""
            slot.unhealthy_at = None
        self._event("started", server=slot.name, gen=slot.gen, node=ip, why=why,
                    log=log)  # fmt: skip
        if slot.role == "ffn" and self.plan["relayed"]:
            self._point_relays()
        return True

    def _point_relays(self) -> None:
        addresses = self.ffn_addresses()
        for s in list(self.slots.values()):
            if s.role == "attention" and s.active and s.actor is not None:
                s.actor.set_targets.remote(addresses)

    def _retire(self, slot: Slot, grace: float) -> None:
        import ray

        actor, slot.actor = slot.actor, None
        if actor is None:
            return
        with contextlib.suppress(Exception):
            ray.get(actor.stop.remote(grace), timeout=grace + 30)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)

    # -- commands -------------------------------------------------------
    def up(self) -> dict[str, Any]:
        for slot in self._ffn_slots():
            if not self._start(slot, "up"):
                raise RuntimeError(f"{slot.name}: no node with its resources: {slot.error}")
        for name in self.plan["initial"]:
            if not self._start(self.slots[name], "up"):
                raise RuntimeError(f"{name}: no node with its resources: {self.slots[name].error}")
        self._monitor = threading.Thread(target=self._watch, name="afd-supervisor", daemon=True)
        self._monitor.start()
        self._wait_healthy([s for s in self.slots.values() if s.active],
                           self.plan["start_timeout_s"])  # fmt: skip
        self._event("up", endpoints=self.endpoints())
        return self.status()

    def _wait_healthy(self, slots: list[Slot], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                pending = [s.name for s in slots if s.state != "healthy"]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy within {timeout:g} s: {pending}")
            time.sleep(0.5)

    def endpoints(self) -> list[str]:
        return [f"http://{join_address(s.node['ip'], s.spec['http_port'])}"
                for s in self.slots.values()
                if s.role == "attention" and s.state == "healthy"]  # fmt: skip

    def scale(self, count: int) -> dict[str, Any]:
        """Run ``count`` attention slots: start the free slots of the least loaded FFN ranks,
        or drain (no request running or waiting) and stop the surplus."""
        att = [s for s in self.slots.values() if s.role == "attention"]
        if not self.plan["elastic"]:
            raise ValueError(
                "scale: this topology reserves no spare attention slots (attention.max_ranks "
                "== attention.ranks), so its FFN ranks wait for every slot when they start: "
                "deploy it with attention.max_ranks > attention.ranks to scale"
            )
        if not 1 <= count <= len(att):
            raise ValueError(f"scale attention {count}: this deployment has {len(att)} attention "
                             f"slots (attention.max_ranks); 1..{len(att)}")  # fmt: skip
        order = self.plan["slot_order"]
        with self._lock:
            running = [n for n in order if self.slots[n].active]
        want = order[:count]
        started = [self.slots[n] for n in want if n not in running]
        stopping = [self.slots[n] for n in running if n not in want]
        self._event("scale", to=count, start=[s.name for s in started],
                    stop=[s.name for s in stopping])  # fmt: skip
        for slot in stopping:
            with self._lock:
                slot.state = "draining"
        threads = [threading.Thread(target=self._drain_and_stop, args=(s,)) for s in stopping]
        for t in threads:
            t.start()
        for slot in started:
            if not self._start(slot, "scale"):
                raise RuntimeError(f"{slot.name}: no node with its resources: {slot.error}")
        for t in threads:
            t.join()
        self._wait_healthy(started, self.plan["start_timeout_s"])
        return self.status()

    def _drain_and_stop(self, slot: Slot) -> None:
        import ray

        deadline = time.monotonic() + self.plan["drain_timeout_s"]
        load = None
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                load = ray.get(slot.actor.load.remote(), timeout=10)
            if load == 0:
                break
            time.sleep(0.5)
        self._retire(slot, grace=30.0)
        with self._lock:
            slot.state, slot.started_at, slot.healthy_at = "stopped", None, None
        self._event("stopped", server=slot.name, gen=slot.gen, drained=load == 0)

    def down(self) -> list[str]:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(30)
        active = [s for s in self.slots.values() if s.actor is not None]
        threads = [threading.Thread(target=self._retire, args=(s, 30.0)) for s in active]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in active:
            s.state = "stopped"
        self._event("down", stopped=[s.name for s in active])
        return [s.name for s in active]

    def status(self) -> dict[str, Any]:
        now = time.time()
        rows = []
        with self._lock:
            for s in self.slots.values():
                if s.role == "ffn":
                    address = ", ".join(
                        join_address(s.node.get("ip", "-"), self.plan["afd_ports"][f])
                        for f in s.spec["ffn_ranks"])  # fmt: skip
                else:
                    address = (f"http://{join_address(s.node['ip'], s.spec['http_port'])}"
                               if s.node else "-")  # fmt: skip
                rows.append({
                    "server": s.name, "role": s.role,
                    "rank": ",".join(map(str, s.spec["ffn_ranks"])) if s.role == "ffn"
                    else str(s.spec["index"]),
                    "node": s.node.get("ip", "-") if s.active or s.state == "draining" else "-",
                    "address": address if s.active or s.state == "draining" else "-",
                    "health": s.state, "restarts": s.restarts,
                    "uptime_s": round(now - s.started_at, 1) if s.started_at else None,
                    "error": s.error,
                })  # fmt: skip
            events = list(self.events)
        return {"name": self.plan["name"], "servers": rows, "endpoints": self.endpoints(),
                "restarts": sum(s.restarts for s in self.slots.values()),
                "events": events}  # fmt: skip

    # -- the watch ------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.plan["health_period_s"]):
            for slot in list(self.slots.values()):
                if self._stop.is_set():
                    return
                if slot.active:
                    with contextlib.suppress(Exception):
                        self._check(slot)

    def _check(self, slot: Slot) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if slot.actor is None:  # lost and not placed yet: try again
            self._restart(slot, slot.error or "not placed")
            return
        try:
            rc = ray.get(slot.actor.poll.remote(), timeout=10)
        except RayActorError as e:
            self._restart(slot, f"its actor or node died ({type(e).__name__})")
            return
        except GetTimeoutError:
            slot.missed += 1
            if slot.missed >= self.plan["missed_polls"]:
                self._restart(slot, f"its actor did not answer {slot.missed} polls")
            return
        slot.missed = 0
        if rc is not None:
            self._restart(slot, f"its server exited with code {rc}")
            return
        code = ray.get(slot.actor.health.remote(), timeout=10)
        with self._lock:
            if slot.state == "draining":
                return
            if code == 200:
                if slot.state != "healthy":
                    now = time.time()
                    since = slot.unhealthy_at or slot.started_at
                    what = "started" if slot.unhealthy_at is None else "unhealthy"
                    slot.healthy_at, slot.unhealthy_at = now, None
                    self._event("healthy", server=slot.name, gen=slot.gen,
                                **{f"after_{what}_s": round(now - since, 1)})  # fmt: skip
                slot.state = "healthy"
            elif slot.state == "healthy":
                # An attention server answers 503 while it waits for a lost FFN rank.
                slot.state, slot.unhealthy_at = "unhealthy", time.time()
                self._event("unhealthy", server=slot.name, gen=slot.gen, http=code)

    def _restart(self, slot: Slot, why: str) -> None:
        import ray

        with self._lock:
            if slot.state == "draining" or self._stop.is_set():
                return
            first = slot.state != "lost" or slot.actor is not None
            slot.state = "lost"
        if slot.actor is not None:
            old, slot.actor = slot.actor, None
            with contextlib.suppress(Exception):
                ray.get(old.stop.remote(5.0), timeout=10)
            with contextlib.suppress(Exception):
                ray.kill(old, no_restart=True)
        if first:
            slot.restarts += 1
            self._event("lost", server=slot.name, gen=slot.gen, why=why,
                        node=slot.node.get("ip"), restarts=slot.restarts)  # fmt: skip
        self._start(slot, f"restart: {why}")
