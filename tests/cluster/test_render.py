"""`pdserve render serve|kuberay`: the generated files are valid for Ray Serve's own
schema, build the same application, and pin each pool to its node group."""

import json

import yaml

from pdserve.config import ClusterConfig
from pdserve_app.render import dump, kuberay, serve_config


def test_serve_config_passes_ray_serves_schema_and_builds_the_app():
    from ray.serve.schema import ServeDeploySchema

    from pdserve_app.deploy import app_builder

    cfg = ClusterConfig.from_dict({"prefill": {"ray_actor_options": {"num_cpus": 4, "resources": {"prefill_node": 1}}}})
    raw = yaml.safe_load(dump(serve_config(cfg)))
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(raw)
    app = schema.applications[0]
    assert app.import_path == "pdserve_app.deploy:app_builder" and "grpc_options" not in raw  # the router serves gRPC itself
    pinned = ClusterConfig.from_dict(app.args["config"])
    assert pinned.prefill.ray_actor_options["resources"] == {"prefill_node": 1}  # the user's own resource is kept
    assert pinned.decode.ray_actor_options["resources"] == {"pdserve_decode_node": 0.001}  # none given: one is made up
    assert pinned.router.host == "0.0.0.0" and pinned.router.ray_actor_options["resources"] == {"pdserve_router_node": 0.001}
    assert app_builder(app.args) is not None  # Ray Serve's builder path builds the application


def test_kuberay_manifest_has_a_worker_group_per_pool_offering_its_resource():
    cfg = ClusterConfig.from_dict({"decode": {"autoscaling_config": {"min_replicas": 2, "max_replicas": 6}, "ray_actor_options": {"num_cpus": 2, "num_gpus": 1}}})
    manifest = yaml.safe_load(dump(kuberay(cfg, "registry.example/pdserve:1", "2.60.0")))
    assert manifest["kind"] == "RayService" and manifest["apiVersion"] == "ray.io/v1"
    spec = manifest["spec"]
    groups = {g["groupName"]: g for g in spec["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    decode = groups["decode"]
    assert (decode["minReplicas"], decode["maxReplicas"], decode["rayStartParams"]["num-gpus"]) == (2, 6, "1")
    assert json.loads(json.loads(decode["rayStartParams"]["resources"])) == {"pdserve_decode_node": 1}
    assert decode["template"]["spec"]["containers"][0]["image"] == "registry.example/pdserve:1"
    serve = yaml.safe_load(spec["serveConfigV2"])
    assert serve["applications"][0]["args"]["config"]["decode"]["ray_actor_options"]["resources"] == {"pdserve_decode_node": 0.001}


def test_colocated_renders_one_pool_group():
    manifest = kuberay(ClusterConfig.from_dict({"mode": "colocated"}), "img", "2.60.0")
    assert [g["groupName"] for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]] == ["colocated"]


def test_env_secrets_come_from_a_kubernetes_secret_not_the_manifest():
    cfg = ClusterConfig.from_dict({"security": {"api_key": "env:PDSERVE_API_KEY", "kv_secret": "env:PDSERVE_KV_SECRET"}})
    text = dump(kuberay(cfg, "img", "2.60.0", secret_name="my-secrets"))
    assert "&id" not in text and "*id" not in text  # plain Kubernetes YAML, no anchors
    manifest = yaml.safe_load(text)
    cluster = manifest["spec"]["rayClusterConfig"]
    containers = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]] + [g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]]
    for container in containers:  # the head builds the app (reads api_key), every pod may host a replica
        assert container["env"] == [
            {"name": "PDSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "my-secrets", "key": "PDSERVE_API_KEY"}}},
            {"name": "PDSERVE_KV_SECRET", "valueFrom": {"secretKeyRef": {"name": "my-secrets", "key": "PDSERVE_KV_SECRET"}}},
        ]
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]["config"]["security"]["api_key"] == "env:PDSERVE_API_KEY"
