# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm.afd.deploy``: validate, render, up, status, scale, down (docs/deployment.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm.afd.deploy.topology import TopologyError, load


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm.afd.deploy",
                                description="Deploy AFD (attention and FFN ranks of vLLM) on "
                                            "Ray or Kubernetes from a topology file.")  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)

    def ray_args(sp, topology: bool) -> None:
        if topology:
            sp.add_argument("topology", help="the topology file (JSON, or YAML with PyYAML)")
        else:
            sp.add_argument("topology", nargs="?", help="the topology file (its Ray namespace)")
            sp.add_argument("--namespace", help="the Ray namespace (default afd-<name>)")
        sp.add_argument("--address", default="auto",
                        help="the Ray cluster (default auto: the local node's cluster; "
                             "ray://HOST:10001 for Ray Client)")  # fmt: skip

    sp = sub.add_parser("validate", help="check a topology file; print its servers")
    sp.add_argument("topology")
    sp = sub.add_parser("render", help="write Kubernetes manifests (and the KubeRay variant)")
    sp.add_argument("topology")
    sp.add_argument("--out", required=True, help="the folder to write them into")
    ray_args(sub.add_parser("up", help="start the deployment on a running Ray cluster"), True)
    ray_args(sub.add_parser("status", help="the servers: rank, node, address, health, "
                                           "restarts, uptime"), False)  # fmt: skip
    sp = sub.add_parser("scale", help="scale attention N: run N attention slots")
    sp.add_argument("role", choices=["attention"])
    sp.add_argument("count", type=int)
    ray_args(sp, False)
    ray_args(sub.add_parser("down", help="stop everything the deployment started"), False)
    for name in ("up", "status", "scale", "down"):
        sub.choices[name].add_argument("--json", action="store_true", help="print JSON")
    return p


def namespace_of(args) -> str:
    if getattr(args, "namespace", None):
        return args.namespace
    if args.topology is None:
        raise TopologyError("give the topology file or --namespace")
    return load(args.topology).ray["namespace"]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except TopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the launcher's errors, said in one line
        from vllm.afd.deploy.ray_launcher import DeployError

        if isinstance(e, (DeployError, ValueError, TimeoutError)):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


def run(args) -> int:
    if args.command == "validate":
        topo = load(args.topology)
        for s in (*topo.ffn_servers(), *topo.attention_servers()):
            print(f"{s.name}: port {s.http_port}, resources {s.resources}")
        return 0
    if args.command == "render":
        from vllm.afd.deploy import render

        topo = load(args.topology)
        text = Path(args.topology).read_text()
        topology_json = text if args.topology.endswith(".json") else json.dumps(
            _raw(args.topology), indent=2)  # fmt: skip
        for path in render.write(topo, topology_json, args.out):
            print(path)
        return 0
    from vllm.afd.deploy import ray_launcher as rl

    if args.command == "up":
        st = rl.up(load(args.topology), args.address)
    elif args.command == "status":
        st = rl.status(namespace_of(args), args.address)
    elif args.command == "scale":
        st = rl.scale(namespace_of(args), args.address, args.count)
    else:
        stopped = rl.down(namespace_of(args), args.address)
        print(json.dumps({"stopped": stopped}, indent=2) if args.json else
              f"stopped: {' '.join(stopped) or 'nothing'}")  # fmt: skip
        return 0
    print(json.dumps(st, indent=2) if args.json else rl.format_status(st))
    return 0


def _raw(path: str):
    import yaml

    return yaml.safe_load(Path(path).read_text())


if __name__ == "__main__":
    sys.exit(main())
