# SPDX-License-Identifier: Apache-2.0
"""``up`` / ``status`` / ``scale`` / ``down`` of a topology on a running Ray cluster.

The supervisor (``actors.Supervisor``) is a detached, named actor (``supervisor`` in the
topology's namespace, ``afd-<name>`` by default) on the node that ran ``up``; it places one
detached actor per server (``ffn-0-g1``, ``attention-1-g2``: server and generation), each
running its ``vllm serve`` on a node that has the role's resources (``cpus``, ``gpus`` and the
custom Ray resources of ``ray_resources``, e.g. ``{"afd_ffn": 1}`` on the nodes started with
``ray start --resources '{"afd_ffn": 1}'``), and keeps the deployment's state: every command
after ``up`` asks it. ``ray`` is imported here only, with a clear error when it is missing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

from vllm.afd.deploy import actors
from vllm.afd.deploy.topology import Topology

SUPERVISOR = "supervisor"


class DeployError(RuntimeError):
    """A launcher command that cannot be carried out; the message says why."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise DeployError(
            "the Ray launcher needs Ray: pip install ray (the project pins ray==2.60.0); "
            "`render` writes Kubernetes manifests without it"
        ) from None
    return ray


def plan(topo: Topology) -> dict[str, Any]:
    """What the supervisor needs of the topology (plain data: the supervisor imports no
    vLLM module)."""
    servers = []
    ffn_servers = topo.ffn_servers()
    base = topo.ray["internal_port_base"]
    for i, server in enumerate((*ffn_servers, *topo.attention_servers())):
        afd = topo.afd_config(server, "", [])
        env = topo.server_env(server)
        if base is not None:
            env.setdefault("VLLM_PORT", str(base + 100 * i))
        servers.append({
            "name": server.name, "role": server.role, "index": server.index,
            "ffn_ranks": list(server.ffn_ranks), "http_port": server.http_port,
            "afd_config": afd, "args": topo.serve_args(server), "env": env,
            "resources": {"cpus": server.resources.cpus, "gpus": server.resources.gpus,
                          "ray_resources": dict(server.resources.ray_resources)},
        })  # fmt: skip
    initial = [f"attention-{a}" for a in topo.initial_slots()]
    order = [f"attention-{a}" for a in topo.initial_slots(topo.attention.max_ranks)]
    # slot_order: scale up takes slots in this order, scale down gives them back from the end
    order = initial + [n for n in order if n not in initial]
    timeout = float(topo.afd.get("timeout_s", 60.0))
    return {
        "name": topo.name, "namespace": topo.ray["namespace"], "model": topo.model,
        "servers": servers, "initial": initial, "slot_order": order,
        "num_ffn_ranks": topo.num_ffn_ranks,
        "afd_ports": [topo.afd_port(f) for f in range(topo.num_ffn_ranks)],
        "relayed": topo.relayed, "elastic": topo.elastic, "relay_wait_s": timeout,
        "start_timeout_s": topo.ray["start_timeout_s"],
        "drain_timeout_s": topo.ray["drain_timeout_s"],
        "health_period_s": topo.ray["health_period_s"], "log_dir": topo.ray["log_dir"],
        "place_timeout_s": 60.0, "missed_polls": 3,
        "placement_group": f"{topo.name}-one-host" if topo.placement == "one_host" else None,
    }  # fmt: skip


def connect(address: str, namespace: str):
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, log_to_driver=False,
                 logging_level="warning")  # fmt: skip
    # The actors run this module's classes from the pickle, not from an import: their
    # workers import neither vLLM nor torch.
    ray.cloudpickle.register_pickle_by_value(actors)
    return ray


def supervisor(ray, namespace: str):
    try:
        return ray.get_actor(SUPERVISOR, namespace=namespace)
    except ValueError:
        raise DeployError(
            f"no AFD deployment in Ray namespace {namespace!r} (no actor {SUPERVISOR!r}): "
            "`up` it first, or give the topology (or --namespace) it was started with"
        ) from None


def up(topo: Topology, address: str) -> dict[str, Any]:
    ray = connect(address, topo.ray["namespace"])
    with contextlib.suppress(ValueError):
        ray.get_actor(SUPERVISOR, namespace=topo.ray["namespace"])
        raise DeployError(f"namespace {topo.ray['namespace']!r} already runs a deployment: "
                          "`down` it first")  # fmt: skip
    if "VLLM_AFD_SECRET" not in os.environ:
        print("warning: VLLM_AFD_SECRET is not set here; the servers take it from their "
              "nodes' environment (set it before `ray start` on every node, docs/security.md)",
              file=sys.stderr)  # fmt: skip
    p = plan(topo)
    if p["placement_group"] is not None:
        _one_host_group(ray, topo, p["placement_group"])
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    sup = ray.remote(actors.Supervisor).options(
        name=SUPERVISOR, namespace=topo.ray["namespace"], lifetime="detached", num_cpus=0,
        max_concurrency=16, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(p)  # fmt: skip
    try:
        return ray.get(sup.up.remote())
    except Exception:
        # A deployment that did not come up is taken down again: nothing is left behind.
        with contextlib.suppress(Exception):
            ray.get(sup.down.remote(), timeout=120)
        ray.kill(sup, no_restart=True)
        _remove_group(ray, p["placement_group"])
        raise


def _one_host_group(ray, topo: Topology, name: str) -> None:
    """placement one_host: every server in one STRICT_PACK placement group (one node)."""
    from ray.util.placement_group import placement_group

    bundles = []
    for s in (*topo.ffn_servers(), *topo.attention_servers()):
        b = {"CPU": s.resources.cpus, **s.resources.ray_resources}
        if s.resources.gpus:
            b["GPU"] = s.resources.gpus
        bundles.append(b)
    pg = placement_group(bundles, strategy="STRICT_PACK", name=name, lifetime="detached")
    if not pg.wait(topo.ray["start_timeout_s"]):
        ray.util.remove_placement_group(pg)
        raise DeployError(f"placement one_host: no single node has the resources of every "
                          f"server ({bundles})")  # fmt: skip


def _remove_group(ray, name: str | None) -> None:
    if name is None:
        return
    with contextlib.suppress(Exception):
        ray.util.remove_placement_group(ray.util.get_placement_group(name))


def status(namespace: str, address: str) -> dict[str, Any]:
    ray = connect(address, namespace)
    return ray.get(supervisor(ray, namespace).status.remote(), timeout=60)


def scale(namespace: str, address: str, count: int) -> dict[str, Any]:
    ray = connect(address, namespace)
    sup = supervisor(ray, namespace)
    try:
        return ray.get(sup.scale.remote(count))
    except ray.exceptions.RayTaskError as e:
        raise DeployError(str(e.cause if e.cause is not None else e)) from None


def down(namespace: str, address: str) -> list[str]:
    """Stop every server, the supervisor and any actor left in the namespace."""
    ray = connect(address, namespace)
    stopped: list[str] = []
    with contextlib.suppress(ValueError):
        sup = ray.get_actor(SUPERVISOR, namespace=namespace)
        with contextlib.suppress(Exception):
            stopped = ray.get(sup.down.remote(), timeout=300)
        ray.kill(sup, no_restart=True)
    from ray.util import list_named_actors

    # Anything of the namespace that the supervisor no longer knew (it died, a half-done up).
    for entry in list_named_actors(all_namespaces=True):
        if entry.get("namespace") == namespace:
            with contextlib.suppress(Exception):
                actor = ray.get_actor(entry["name"], namespace=namespace)
                with contextlib.suppress(Exception):
                    ray.get(actor.stop.remote(30.0), timeout=60)
                ray.kill(actor, no_restart=True)
                stopped.append(entry["name"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(
        e.get("namespace") == namespace for e in list_named_actors(all_namespaces=True)
    ):
        time.sleep(0.5)
    with contextlib.suppress(Exception):
        pg_name = f"{namespace.removeprefix('afd-')}-one-host"
        _remove_group(ray, pg_name)
    return stopped


def format_status(st: dict[str, Any]) -> str:
    """The status table (server, rank, node, address, health, restarts, uptime) and the
    restart log."""
    head = ("SERVER", "ROLE", "RANK", "NODE", "ADDRESS", "HEALTH", "RESTARTS", "UPTIME")
    rows = [head]
    for r in st["servers"]:
        up = "-" if r["uptime_s"] is None else f"{r['uptime_s']:.0f}s"
        rows.append((r["server"], r["role"], r["rank"], r["node"], r["address"], r["health"],
                     str(r["restarts"]), up))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"endpoints: {' '.join(st['endpoints']) or '-'}")
    lines.append(f"restarts: {st['restarts']}")
    for e in st["events"]:
        if e["what"] in ("lost", "started", "stopped", "scale"):
            info = {k: v for k, v in e.items() if k not in ("t", "what", "log")}
            lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e['t']))} {e['what']} {info}")
    return "\n".join(lines)
