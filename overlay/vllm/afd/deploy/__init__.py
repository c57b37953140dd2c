# SPDX-License-Identifier: Apache-2.0
"""Deploying AFD over several machines (docs/deployment.md).

* ``topology``: the topology file (JSON, or YAML where PyYAML is installed): the model, each
  role's ``vllm serve`` arguments, rank counts, connector, resources and ports; validated
  with errors naming the field; it derives every rank's ``--afd-config`` and command.
* ``render``: Kubernetes manifests of a topology (StatefulSets, Services, the AFD secret, a
  KubeRay ``RayCluster`` that runs the Ray launcher).
* ``ray_launcher``: ``up`` / ``status`` / ``scale`` / ``down`` on a running Ray cluster; ``ray``
  is imported only there (``pip install ray``).
* ``actors``: what runs inside the Ray cluster (the server actor with its FFN relay, the
  supervisor); standard library only, shipped to the cluster by value.

``python -m vllm.afd.deploy --help`` lists the commands.
"""
