from pathlib import Path

import pytest

from pdserve.config import ClusterConfig, ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_repository_cluster_yaml_is_the_embedded_default():
    assert ClusterConfig.load(ROOT / "cluster.yaml") == ClusterConfig()


def test_pools_are_configured_independently():
    cfg = ClusterConfig.from_dict(
        {
            "prefill": {"autoscaling_config": {"min_replicas": 2, "max_replicas": 4}, "ray_actor_options": {"num_cpus": 4, "resources": {"prefill_node": 1}}},
            "decode": {"ray_actor_options": {"num_cpus": 2, "num_gpus": 1}},
        }
    )
    assert cfg.prefill.autoscaling_config["max_replicas"] == 4
    assert cfg.prefill.ray_actor_options["resources"] == {"prefill_node": 1}
    assert cfg.decode.ray_actor_options == {"num_cpus": 2, "num_gpus": 1}
    assert cfg.decode.autoscaling_config["target_ongoing_requests"] == 16  # untouched default


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"prefil": {}}, "unknown section 'prefil'"),
        ({"decode": {"num_cpus": 1}}, "unknown key decode.num_cpus"),
        ({"model": {"dtype": "int4"}}, "model.dtype"),
        ({"kv_transfer": {"backend": "rdma"}}, "kv_transfer.backend"),
        ({"prefill": {"kv_lease_s": 0}}, "kv_lease_s"),
    ],
)
def test_bad_config_names_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        ClusterConfig.from_dict(raw)
