"""Deployment files generated from a cluster.yaml: ``pdserve render serve`` (a Ray Serve
config for ``serve deploy``) and ``pdserve render kuberay`` (a KubeRay ``RayService``).

Both run the same application as ``pdserve up``: Ray Serve imports
``pdserve_app.deploy:app_builder`` with the cluster.yaml mapping as its ``args``. In the
KubeRay manifest each pool gets its own worker group, whose pods advertise the custom
resources the pool asks for in ``ray_actor_options.resources`` (one
``pdserve_<pool>_node`` resource when it asks for none, pinned in the rendered config too),
so prefill and decode replicas land only on their own nodes.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import yaml

from pdserve.config import ClusterConfig
from pdserve_app.deploy import APP_NAME, http_tls


def _pools(cfg: ClusterConfig) -> list[str]:
    return ["colocated"] if cfg.mode == "colocated" else ["prefill", "decode"]


ROUTER_NODE = "pdserve_router_node"  # the head's resource: router replicas (and the client gRPC API they serve) run there


def pinned(cfg: ClusterConfig) -> dict[str, Any]:
    """The cluster.yaml mapping with each pool pinned to its node group's resource, and the
    router to the head node, listening on every interface (the pod's ports)."""
    raw = copy.deepcopy(cfg.to_dict())
    for name in _pools(cfg):
        resources = raw[name]["ray_actor_options"].setdefault("resources", {})
        if not resources:
            resources[f"pdserve_{name}_node"] = 0.001
    router = raw["router"]
    router["ray_actor_options"].setdefault("resources", {}).setdefault(ROUTER_NODE, 0.001)
    if router["host"] == "127.0.0.1":
        router["host"] = "0.0.0.0"
    return raw


def serve_config(cfg: ClusterConfig) -> dict[str, Any]:
    """A Ray Serve config file (ServeDeploySchema) for ``serve deploy``."""
    return {
        "proxy_location": cfg.router.proxy_location,
        "http_options": {"host": "0.0.0.0", "port": cfg.router.http_port, **http_tls(cfg)},
        "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": "pdserve_app.deploy:app_builder",
                          "args": {"config": pinned(cfg)}}],
    }


def secret_env_names(cfg: ClusterConfig) -> list[str]:
    """The environment variables the ``security`` secrets are read from ("env:NAME")."""
    values = (cfg.security.api_key, cfg.security.kv_secret)
    return sorted({v[4:] for v in values if v and v.startswith("env:")})


def _container(name: str, image: str, cpus: float, gpus: float, ports: list[int] = (), env: list[dict] = ()) -> dict[str, Any]:
    limits = {"cpu": str(max(1, int(cpus))), "memory": "8Gi", **({"nvidia.com/gpu": str(int(gpus))} if gpus else {})}
    return {"name": name, "image": image, "resources": {"limits": limits, "requests": dict(limits)},
            **({"ports": [{"containerPort": p} for p in ports]} if ports else {}), **({"env": copy.deepcopy(list(env))} if env else {})}  # own copies: no YAML anchors


def kuberay(cfg: ClusterConfig, image: str, ray_version: str, secret_name: str = "pdserve-secrets") -> dict[str, Any]:
    """A KubeRay RayService (apiVersion ray.io/v1): a head group running the router (which
    serves the gRPC API) and Ray Serve's HTTP proxy, one worker group per pool sized by its
    autoscaling bounds.

    Secrets stay out of the manifest: each "env:NAME" secret becomes the variable NAME in
    every pod, taken from key NAME of the Kubernetes Secret ``secret_name`` (which the
    user creates: ``kubectl create secret generic pdserve-secrets --from-literal=NAME=...``).
    A literal secret in cluster.yaml is carried as is, inside serveConfigV2."""
    raw = pinned(cfg)
    env = [{"name": n, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": n}}} for n in secret_env_names(cfg)]
    groups = []
    for name in _pools(cfg):
        pool = getattr(cfg, name)
        options = raw[name]["ray_actor_options"]
        ranks = pool.tensor_parallel_size  # a replica's ranks share its node: one pod holds them all
        cpus, gpus = float(options.get("num_cpus", 1)) * ranks, float(options.get("num_gpus", 0)) * ranks
        bounds = pool.autoscaling_config
        # KubeRay wants the resources as a quoted JSON string: "{\"prefill_node\": 1}"
        start = {"num-cpus": str(max(1, int(cpus))), "resources": json.dumps(json.dumps({k: 1 for k in options["resources"]}))}
        if gpus:
            start["num-gpus"] = str(int(gpus))
        groups.append({
            "groupName": name, "replicas": bounds.get("min_replicas", 1), "minReplicas": bounds.get("min_replicas", 1),
            "maxReplicas": bounds.get("max_replicas", 1), "rayStartParams": start,
            "template": {"spec": {"containers": [_container("ray-worker", image, cpus, gpus, env=env)]}},
        })
    head = {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0", "resources": json.dumps(json.dumps({ROUTER_NODE: 1}))},
            "template": {"spec": {"containers": [_container("ray-head", image, 2, 0, [6379, 8265, cfg.router.http_port, cfg.router.grpc_port], env)]}}}
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": "pdserve"},
        "spec": {"serveConfigV2": yaml.safe_dump(serve_config(cfg), sort_keys=False),
                 "rayClusterConfig": {"rayVersion": ray_version, "enableInTreeAutoscaling": True,
                                      "headGroupSpec": head, "workerGroupSpecs": groups}},
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as literal blocks, as KubeRay's examples write them."""


_Dumper.add_representer(str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None))


def dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False)
