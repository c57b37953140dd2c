"""Kubernetes manifests of vllm.afd.deploy.render, for the golden topologies (1A1F; 4A2F FFN
replicas with spare attention slots; 4A2F as one FFN group):

* the rendered files equal the golden files in tests/unit/deploy/deploy_golden/<case>/ (what a
  reviewer reads; AFD_UPDATE_GOLDEN=1 writes them anew);
* every object deserializes into its model class of the Kubernetes API (the `kubernetes`
  client pinned in the venv) with no unknown field at any depth and no required field
  missing; the KubeRay RayCluster (a custom resource) through its pod templates;
* the cross references hold: every FFN address is a pod of the FFN StatefulSet under a
  headless Service that publishes not-ready addresses, on a port the Service and the
  container both have; Service selectors and StatefulSet selectors match the pod labels;
  probes name container ports; the secret is the topology's; each pod's --afd-config, its
  rank substituted from the ordinal, passes AFDConfig and the FFN pod listens on its port.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import kubernetes.client as k8s
import pytest
import yaml

from vllm.afd.deploy import render, topology
from vllm.config.afd import AFDConfig, split_address

GOLDEN = Path(__file__).resolve().with_name("deploy_golden")
CASES = {"1a1f": "topology.json", "4a2f_replicas": "topology.json",
         "4a2f_group": "topology.yaml"}  # fmt: skip
MODEL_OF_KIND = {"Service": "V1Service", "StatefulSet": "V1StatefulSet",
                 "ConfigMap": "V1ConfigMap", "Job": "V1Job"}  # fmt: skip
SCALARS = {"str": str, "int": int, "bool": bool, "float": (int, float)}


def rendered(case: str, out: Path) -> dict[str, str]:
    path = GOLDEN / case / CASES[case]
    topo = topology.load(path)
    raw = path.read_text()
    text = raw if path.suffix == ".json" else json.dumps(yaml.safe_load(raw), indent=2)
    files = render.write(topo, text, out)
    return {str(f.relative_to(out)): f.read_text() for f in files}


def strict(data, type_name: str, where: str) -> None:
    """``data`` fits ``type_name`` of the Kubernetes client's models at every depth: no key
    that the model does not define (the client's own deserializer drops those silently)."""
    if type_name.startswith(("List[", "list[")):
        assert isinstance(data, list), f"{where}: expected a list"
        for i, item in enumerate(data):
            strict(item, type_name[5:-1], f"{where}[{i}]")
    elif type_name.startswith(("Dict[", "dict(")):
        assert isinstance(data, dict), f"{where}: expected an object"
        inner = type_name[type_name.index(",") + 1:-1].strip()
        for key, value in data.items():
            strict(value, inner, f"{where}.{key}")
    elif type_name in SCALARS:
        ok = isinstance(data, SCALARS[type_name]) and not (
            type_name != "bool" and isinstance(data, bool))
        assert ok, f"{where}: expected {type_name}, got {data!r}"
    elif type_name == "object":  # IntOrString, quantities
        assert isinstance(data, (str, int)), f"{where}: expected an int or a string"
    else:
        cls = getattr(k8s, type_name)
        assert isinstance(data, dict), f"{where}: expected a {type_name} object"
        attr_of = {v: a for a, v in cls.attribute_map.items()}
        unknown = sorted(set(data) - set(attr_of))
        assert not unknown, f"{where}: fields unknown to {type_name}: {unknown}"
        for key, value in data.items():
            strict(value, cls.openapi_types[attr_of[key]], f"{where}.{key}")


def deserialize(obj: dict, type_name: str):
    """The client's own deserialization: a required field missing raises ValueError."""

    return k8s.ApiClient().deserialize(json.dumps(obj), type_name, "application/json")


def objects(files: dict[str, str]) -> list[dict]:
    return [yaml.safe_load(text) for _, text in sorted(files.items())]


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_matches_golden(case, tmp_path):
    files = rendered(case, tmp_path)
    golden_dir = GOLDEN / case
    if os.environ.get("AFD_UPDATE_GOLDEN") == "1":
        for rel, text in files.items():
            (golden_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (golden_dir / rel).write_text(text)
    golden = {str(p.relative_to(golden_dir)): p.read_text()
              for sub in ("kubernetes", "ray") for p in sorted((golden_dir / sub).glob("*"))}  # fmt: skip
    assert sorted(files) == sorted(golden), "rendered files differ from the golden ones"
    for rel, text in files.items():
        assert text == golden[rel], f"{case}/{rel} differs from its golden file"


@pytest.mark.parametrize("case", sorted(CASES))
def test_objects_fit_the_kubernetes_api(case, tmp_path):
    for obj in objects(rendered(case, tmp_path)):
        where = f"{case}: {obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] == "RayCluster":
            assert obj["apiVersion"] == "ray.io/v1"
            spec = obj["spec"]
            assert set(spec) == {"headGroupSpec", "workerGroupSpecs"}, where
            groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
            for g in groups:
                assert all(isinstance(v, str) for v in g["rayStartParams"].values()), where
                strict(g["template"], "V1PodTemplateSpec", f"{where} template")
                deserialize(g["template"], "V1PodTemplateSpec")
            continue
        model = MODEL_OF_KIND[obj["kind"]]
        strict(obj, model, where)
        parsed = deserialize(obj, model)
        assert parsed.metadata.name == obj["metadata"]["name"]


def test_strict_check_fails_on_unknown_and_missing_fields():
    """The checks above can fail: an unknown field, a wrong type, a missing required one."""
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": 80, "targetPort": "http"}]}}  # fmt: skip
    strict(svc, "V1Service", "svc")
    with pytest.raises(AssertionError, match="unknown to V1ServicePort"):
        strict({**svc, "spec": {"ports": [{"port": 80, "tagetPort": 1}]}}, "V1Service", "svc")
    with pytest.raises(AssertionError, match="expected int"):
        strict({**svc, "spec": {"ports": [{"port": "80"}]}}, "V1Service", "svc")
    with pytest.raises(ValueError, match="port"):
        deserialize({**svc, "spec": {"ports": [{"name": "p"}]}}, "V1Service")


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def afd_configs(sts: dict) -> list[AFDConfig]:
    """The --afd-config of every pod of ``sts``, $(AFD_RANK) replaced by its ordinal."""
    (c,) = pod_spec(sts)["containers"]
    arg = c["args"][c["args"].index("--afd-config") + 1]
    out = []
    for ordinal in range(sts["spec"]["replicas"]):
        if "$(" in arg:
            names = {e["name"] for e in c["env"]}
            assert set(re.findall(r"\$\((\w+)\)", arg)) <= names, "an unset variable"
            rank_env = next(e for e in c["env"] if e["name"] == render.RANK_VAR)
            assert render.POD_INDEX_LABEL in rank_env["valueFrom"]["fieldRef"]["fieldPath"]
        out.append(AFDConfig.from_json(arg.replace(f"$({render.RANK_VAR})", str(ordinal))))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_cross_references(case, tmp_path):
    topo = topology.load(GOLDEN / case / CASES[case])
    objs = render.manifests(topo)
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    sets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "StatefulSet"}
    for name, sts in sets.items():
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        svc = services[sts["spec"]["serviceName"]]
        assert svc["spec"]["selector"].items() <= labels.items(), name
        (c,) = pod_spec(sts)["containers"]
        port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            how = c[probe].get("httpGet") or c[probe]["tcpSocket"]
            assert how["port"] in port_names, (name, probe)
        for sp in svc["spec"]["ports"]:
            assert port_names[sp["targetPort"]] == sp["port"], (name, sp)
        secret = next(e for e in c["env"] if e["name"] == "VLLM_AFD_SECRET")
        assert secret["valueFrom"]["secretKeyRef"] == topo.secret
        configs = afd_configs(sts)
        assert len(configs) == sts["spec"]["replicas"]
        if sts is sets[f"{topo.name}-ffn"]:
            assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
            for ordinal, cfg in enumerate(configs):
                ranks = [ordinal] if topo.ffn.layout == "replicas" else range(cfg.num_ffn_ranks)
                for f in ranks:  # each FFN rank of the pod listens on a declared port
                    assert cfg.ffn_listen_address(f)[1] in port_names.values(), (name, f)
        else:
            assert sts["spec"]["replicas"] == topo.attention.ranks
            assert sts["metadata"]["annotations"]["afd.vllm.ai/max-replicas"] == str(
                topo.attention.max_ranks)  # fmt: skip
            assert [c.rank for c in configs] == list(range(topo.attention.ranks))
    # every FFN address names a pod of the FFN StatefulSet under its headless Service
    for cfg in afd_configs(sets[f"{topo.name}-attention"]):
        assert cfg.num_attention_ranks == topo.attention.max_ranks
        for text in cfg.ffn_addresses:
            host, port = split_address(text)
            pod, _, svc_name = host.partition(".")
            svc = services[svc_name]
            sts = next(s for s in sets.values() if s["spec"]["serviceName"] == svc_name)
            ordinal = int(pod.removeprefix(sts["metadata"]["name"] + "-"))
            assert 0 <= ordinal < sts["spec"]["replicas"], text
            assert port in {p["port"] for p in svc["spec"]["ports"]}, text
            (c,) = pod_spec(sts)["containers"]
            assert port in {p["containerPort"] for p in c["ports"]}, text
    # the Ray variant: the Job mounts the ConfigMap and dials the RayCluster's head service
    config, cluster, job = render.ray_manifests(topo, "{}")
    (vol,) = job["spec"]["template"]["spec"]["volumes"]
    assert vol["configMap"]["name"] == config["metadata"]["name"]
    assert f"{cluster['metadata']['name']}-head-svc" in " ".join(
        job["spec"]["template"]["spec"]["containers"][0]["command"])  # fmt: skip
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    if topo.ffn.resources.ray_resources:
        assert json.loads(groups["ffn"]["rayStartParams"]["resources"]) == \
            topo.ffn.resources.ray_resources  # fmt: skip


def test_one_host_placement_is_not_rendered():
    t = topology.validate({"name": "x", "model": "m", "connector": "cuda_ipc",
                           "placement": "one_host",
                           "attention": {"resources": {"gpus": 1}},
                           "ffn": {"resources": {"gpus": 1}}})  # fmt: skip
    with pytest.raises(ValueError, match="one_host"):
        render.manifests(t)
