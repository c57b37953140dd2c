# SPDX-License-Identifier: Apache-2.0
"""Kubernetes manifests of a topology (``python -m vllm.afd.deploy render FILE --out DIR``).

* FFN ranks: a StatefulSet ``<name>-ffn`` (replicas: one pod per FFN rank; group: one pod
  running every FFN rank with ``--tensor-parallel-size``) and its headless Service
  ``<name>-ffn`` with ``publishNotReadyAddresses``, so that pod ``<name>-ffn-f`` is
  ``<name>-ffn-f.<name>-ffn`` in DNS from its start on. These names are the attention ranks'
  ``ffn_addresses``; an attention rank resolves them again on every dial, so an FFN pod
  started again (any node, any IP) is found by its rejoin.
* Attention slots: a StatefulSet ``<name>-attention`` (``replicas`` = attention.ranks, at
  most attention.max_ranks: ``kubectl scale``) behind the Service ``<name>-attention``.
* A pod's AFD rank is its StatefulSet ordinal (the ``apps.kubernetes.io/pod-index`` label,
  Kubernetes >= 1.28, as ``$(AFD_RANK)`` in the ``--afd-config`` argument).
* Readiness from ``/health``; liveness on the HTTP port's socket (an attention server answers
  503 on /health while it waits for a lost FFN rank to come back: a liveness probe on /health
  would kill exactly the server that is holding requests); a startup probe for slow starts.
  GPUs as ``nvidia.com/gpu`` limits; the AFD secret from the Secret the topology names
  (created by the operator, never rendered).
* The Ray variant: the topology in a ConfigMap, a KubeRay ``RayCluster`` whose worker
  groups carry the roles' Ray resources, and a Job that runs ``python -m vllm.afd.deploy up``
  against it through Ray Client.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm.afd.deploy.topology import Role, Topology

APP = "vllm-afd"
ROLE_LABEL = "afd.vllm.ai/role"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
RANK_VAR = "AFD_RANK"
RAY_CLIENT_PORT = 10001
START_PROBE_S = 900  # a large checkpoint's load on a cold node


def labels(topo: Topology, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": topo.name,
            ROLE_LABEL: role}  # fmt: skip


def ffn_service(topo: Topology) -> str:
    return f"{topo.name}-ffn"


def ffn_addresses(topo: Topology) -> list[str]:
    """The stable DNS names of the FFN ranks (pod f of the FFN StatefulSet; every rank of a
    group in its one pod, on ports afd_port + f)."""
    svc = ffn_service(topo)
    if topo.ffn.layout == "group":
        return [f"{svc}-0.{svc}:{topo.afd_port(f)}" for f in range(topo.num_ffn_ranks)]
    return [f"{svc}-{f}.{svc}:{topo.ffn.afd_port}" for f in range(topo.num_ffn_ranks)]


def _afd_arg(topo: Topology, role: str) -> str:
    """The --afd-config argument; ``"rank": $(AFD_RANK)`` where the pod's ordinal is its rank."""
    server = topo.attention_servers()[0] if role == "attention" else topo.ffn_servers()[0]
    cfg = topo.afd_config(server, "0.0.0.0", ffn_addresses(topo))
    if "rank" in cfg:
        cfg["rank"] = "__RANK__"
    return json.dumps(cfg, sort_keys=True).replace('"__RANK__"', f"$({RANK_VAR})")


def _resources(topo: Topology, role: str) -> dict[str, Any]:
    res = topo.attention.resources if role == "attention" else topo.ffn_servers()[0].resources
    requests: dict[str, str] = {"cpu": f"{res.cpus:g}"}
    limits: dict[str, str] = {}
    if res.memory:
        requests["memory"] = limits["memory"] = res.memory
    if res.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(res.gpus)
    out: dict[str, Any] = {"requests": requests}
    if limits:
        out["limits"] = limits
    return out


def _env(topo: Topology, role: Role, ranked: bool) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in {**topo.env, **role.env}.items()]
    env.append({"name": "VLLM_AFD_SECRET", "valueFrom": {"secretKeyRef": {
        "name": topo.secret["name"], "key": topo.secret["key"]}}})  # fmt: skip
    if ranked:
        env.append({"name": RANK_VAR, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}})  # fmt: skip
    return env


def _container(topo: Topology, role_name: str) -> dict[str, Any]:
    role = topo.attention if role_name == "attention" else topo.ffn
    server = topo.attention_servers()[0] if role_name == "attention" else topo.ffn_servers()[0]
    ranked = role_name == "attention" or topo.ffn.layout == "replicas"
    ports = [{"name": "http", "containerPort": role.http_port}]
    if role_name == "ffn":
        if topo.ffn.layout == "group":
            ports += [{"name": f"afd-{f}", "containerPort": topo.afd_port(f)}
                      for f in range(topo.num_ffn_ranks)]  # fmt: skip
        else:
            ports.append({"name": "afd", "containerPort": topo.ffn.afd_port})
        if topo.connector == "nccl":
            ports.append({"name": "afd-store", "containerPort": topo.ffn.afd_port + 1})
    args = ["serve", topo.model, "--host", "0.0.0.0", "--port", str(role.http_port),
            "--afd-config", _afd_arg(topo, role_name), *topo.serve_args(server)]  # fmt: skip
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    container: dict[str, Any] = {
        "name": f"vllm-{role_name}",
        "image": topo.image or "vllm-afd:latest",
        "command": ["vllm"],
        "args": args,
        "ports": ports,
        "env": _env(topo, role, ranked),
        "resources": _resources(topo, role_name),
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": START_PROBE_S // 10},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    }  # fmt: skip
    return container


def _statefulset(topo: Topology, role_name: str, replicas: int, service: str) -> dict[str, Any]:
    role = topo.attention if role_name == "attention" else topo.ffn
    lab = labels(topo, role_name)
    spec: dict[str, Any] = {
        "serviceName": service,
        "replicas": replicas,
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": lab},
        "template": {
            "metadata": {"labels": lab},
            "spec": {
                "containers": [_container(topo, role_name)],
                "terminationGracePeriodSeconds": 60,
                "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
            },
        },
    }
    if role.resources.node_labels:
        spec["template"]["spec"]["nodeSelector"] = dict(role.resources.node_labels)
    meta: dict[str, Any] = {"name": f"{topo.name}-{role_name}", "labels": lab}
    if role_name == "attention":
        meta["annotations"] = {"afd.vllm.ai/max-replicas": str(topo.attention.max_ranks)}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta, "spec": spec}


def _services(topo: Topology) -> list[dict[str, Any]]:
    ffn_ports = [{"name": "http", "port": topo.ffn.http_port, "targetPort": "http"}]
    if topo.ffn.layout == "group":
        ffn_ports += [{"name": f"afd-{f}", "port": topo.afd_port(f), "targetPort": f"afd-{f}"}
                      for f in range(topo.num_ffn_ranks)]  # fmt: skip
    else:
        ffn_ports.append({"name": "afd", "port": topo.ffn.afd_port, "targetPort": "afd"})
    if topo.connector == "nccl":
        ffn_ports.append({"name": "afd-store", "port": topo.ffn.afd_port + 1,
                          "targetPort": "afd-store"})  # fmt: skip
    ffn = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": ffn_service(topo), "labels": labels(topo, "ffn")},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": labels(topo, "ffn"), "ports": ffn_ports},
    }  # fmt: skip
    attention = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": f"{topo.name}-attention", "labels": labels(topo, "attention")},
        "spec": {"selector": labels(topo, "attention"),
                 "ports": [{"name": "http", "port": topo.attention.http_port,
                            "targetPort": "http"}]},
    }  # fmt: skip
    return [ffn, attention]


def manifests(topo: Topology) -> list[dict[str, Any]]:
    """Plain Kubernetes: the FFN headless Service and StatefulSet, the attention Service and
    StatefulSet."""
    if topo.placement == "one_host":
        raise ValueError(
            f"render: placement one_host (connector {topo.connector!r}) is not rendered for "
            "Kubernetes: both roles would have to share one pod's GPUs; run it with the Ray "
            "launcher or on one host"
        )
    ffn_svc, att_svc = _services(topo)
    ffn_replicas = len(topo.ffn_servers())
    return [
        ffn_svc,
        _statefulset(topo, "ffn", ffn_replicas, ffn_service(topo)),
        att_svc,
        _statefulset(topo, "attention", topo.attention.ranks, f"{topo.name}-attention"),
    ]


def ray_manifests(topo: Topology, topology_json: str) -> list[dict[str, Any]]:
    """The KubeRay variant: the topology as a ConfigMap, a RayCluster with one worker group
    per role (a worker per server, the role's Ray resources on it) and a Job that runs the
    launcher's ``up`` through Ray Client."""
    name = topo.name
    image = topo.image or "vllm-afd:latest"
    secret_env = _env(topo, topo.ffn, ranked=False)[-1:]

    def pod(role_name: str, ray_port_names: bool = False) -> dict[str, Any]:
        role = topo.attention if role_name == "attention" else topo.ffn
        res = _resources(topo, role_name) if role_name != "head" else {
            "requests": {"cpu": "1", "memory": "4Gi"}}  # fmt: skip
        container: dict[str, Any] = {
            "name": "ray-head" if role_name == "head" else f"ray-{role_name}",
            "image": image, "resources": res, "env": list(secret_env),
        }  # fmt: skip
        if ray_port_names:
            container["ports"] = [{"name": "gcs", "containerPort": 6379},
                                  {"name": "client", "containerPort": RAY_CLIENT_PORT}]  # fmt: skip
        spec: dict[str, Any] = {"containers": [container]}
        if role_name != "head" and role.resources.node_labels:
            spec["nodeSelector"] = dict(role.resources.node_labels)
        return {"metadata": {"labels": labels(topo, f"ray-{role_name}")}, "spec": spec}

    def group(role_name: str, replicas: int) -> dict[str, Any]:
        role = topo.attention if role_name == "attention" else topo.ffn
        res = topo.ffn_servers()[0].resources if role_name == "ffn" else role.resources
        params = {"num-cpus": f"{res.cpus:g}"}
        if res.gpus:
            params["num-gpus"] = str(res.gpus)
        if res.ray_resources:
            params["resources"] = json.dumps(res.ray_resources, sort_keys=True)
        return {"groupName": role_name, "replicas": replicas, "minReplicas": replicas,
                "maxReplicas": replicas, "rayStartParams": params,
                "template": pod(role_name)}  # fmt: skip

    cluster = {
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": {"name": f"{name}-ray", "labels": labels(topo, "ray")},
        "spec": {
            "headGroupSpec": {"rayStartParams": {"num-cpus": "0"},
                              "template": pod("head", ray_port_names=True)},
            "workerGroupSpecs": [group("ffn", len(topo.ffn_servers())),
                                 group("attention", topo.attention.max_ranks)],
        },
    }  # fmt: skip
    config = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": f"{name}-topology", "labels": labels(topo, "ray")},
        "data": {"topology.json": topology_json},
    }  # fmt: skip
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": f"{name}-ray-up", "labels": labels(topo, "ray-up")},
        "spec": {"backoffLimit": 2, "template": {
            "metadata": {"labels": labels(topo, "ray-up")},
            "spec": {"restartPolicy": "OnFailure", "containers": [{
                "name": "afd-up", "image": image,
                "command": ["python", "-m", "vllm.afd.deploy", "up",
                            "/etc/afd/topology.json", "--address",
                            f"ray://{name}-ray-head-svc:{RAY_CLIENT_PORT}"],
                "env": list(secret_env),
                "volumeMounts": [{"name": "topology", "mountPath": "/etc/afd"}],
            }], "volumes": [{"name": "topology", "configMap": {"name": f"{name}-topology"}}]},
        }},
    }  # fmt: skip
    return [config, cluster, job]


def have_yaml() -> bool:
    try:
        import yaml  # noqa: F401
    except ImportError:
        return False
    return True


def dump(obj: Any) -> str:
    """YAML where PyYAML is installed (block style, keys in the order written), else JSON."""
    if not have_yaml():
        return json.dumps(obj, indent=2) + "\n"
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data):  # every object written out where it is used
            return True

    return yaml.dump(obj, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=100)


def write(topo: Topology, topology_json: str, out: str | Path) -> list[Path]:
    """Every manifest into ``out``: kubernetes/NN-kind-name.yaml and ray/NN-kind-name.yaml."""
    out = Path(out)
    written = []
    for sub, objs in (("kubernetes", manifests(topo)), ("ray", ray_manifests(topo, topology_json))):
        (out / sub).mkdir(parents=True, exist_ok=True)
        for i, obj in enumerate(objs):
            ext = "yaml" if have_yaml() else "json"
            path = out / sub / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.{ext}"
            path.write_text(dump(obj))
            written.append(path)
    return written
