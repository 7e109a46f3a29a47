"""Node pools on several nodes (issue 7): a Ray cluster of a head and three worker raylets
on this machine, each worker with a custom resource naming its node group. The pools are
pinned by cluster.yaml's ``ray_actor_options.resources`` and ``pdserve up --address``
joins the cluster. With prefill and decode on different nodes the KV goes over grpc;
with both on one node, over shm (``kv_transfer.backend: auto``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e
RAY_PORT, GRPC_PORT, HTTP_PORT = 6391, 9180, 8180
NODES = {"prefill_nodes": 1, "decode_nodes": 1, "shared_node": 1}  # one worker raylet per resource
RAY = str(Path(sys.executable).parent / "ray")


def ray_cli(*args: str) -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([RAY, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, timeout=120)


@pytest.fixture(scope="module")
def cluster_address():
    # Ray 2.60 turns token authentication on for a cluster started by `ray start` but not for
    # raylets joining it; a local test cluster runs without it (every process inherits this)
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_AUTH_MODE", "disabled")
    address = f"127.0.0.1:{RAY_PORT}"
    ray_cli("start", "--head", f"--port={RAY_PORT}", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--include-dashboard=false",
            "--disable-usage-stats")
    try:
        for resource in NODES:
            ray_cli("start", f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=1", f"--resources={json.dumps({resource: 1})}")
        import ray

        ray.init(address=address, log_to_driver=False)  # this process, to read placement and stats
        yield address
    finally:
        import ray
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()  # also stops this process's handles, whose background tasks would re-init Ray
        ray.shutdown()
        subprocess.run([sys.executable, "-m", "pdserve_app.cli", "down"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
        subprocess.run([RAY, "stop", "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        mp.undo()


def up(address: str, tmp_path: Path, prefill_resource: str, decode_resource: str) -> None:
    pool = lambda r: {"ray_actor_options": {"num_cpus": 0.5, "resources": {r: 0.5}}, "kv_cache_tokens": 8192}  # noqa: E731
    config = {"router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT, "proxy_location": "HeadOnly"},
              "prefill": pool(prefill_resource), "decode": pool(decode_resource)}
    path = tmp_path / f"cluster-{prefill_resource}-{decode_resource}.yaml"
    path.write_text(yaml.safe_dump(config))
    subprocess.run([sys.executable, "-m", "pdserve_app.cli", "up", str(path), "--address", address, "--redeploy"], check=True, timeout=600)


def node_of(resource: str) -> str:
    import ray

    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def pool_stats(name: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(name, "pdserve").stats.remote().result(timeout_s=30)


@pytest.mark.parametrize("prefill_resource, decode_resource, transport", [
    ("prefill_nodes", "decode_nodes", "grpc"),  # different nodes
    ("shared_node", "shared_node", "shm"),  # one node
])
def test_pools_land_on_their_node_groups_and_kv_takes_the_right_transport(cluster_address, tmp_path, prefill_resource, decode_resource, transport):
    from pdserve.client import Client

    from kv_transfer import shm_backend

    if transport == "shm" and not shm_backend.available():
        transport = "grpc"  # auto on one node falls back to grpc where shm's C block copy cannot be built
    up(cluster_address, tmp_path, prefill_resource, decode_resource)
    with Client(f"127.0.0.1:{GRPC_PORT}") as client:
        result = client.generate(prompt_token_ids=list(range(3000, 3100)), max_tokens=8, ignore_eos=True)
    assert len(result.token_ids) == 8
    prefill, decode = pool_stats("prefill"), pool_stats("decode")
    assert prefill["node_id"] == node_of(prefill_resource) and decode["node_id"] == node_of(decode_resource)
    assert decode[f"kv_num_fetched_{transport}"] >= 1
    assert decode.get(f"kv_num_fetched_{'shm' if transport == 'grpc' else 'grpc'}", 0) == 0
