from pathlib import Path

import pytest

from pdserve.config import ClusterConfig, ConfigError

ROOT = Path(__file__).resolve().parents[2]


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
    assert cfg.decode.autoscaling_config["downscale_delay_s"] == 60  # untouched default


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"prefil": {}}, "unknown section 'prefil'"),
        ({"decode": {"num_cpus": 1}}, "unknown key decode.num_cpus"),
        ({"model": {"dtype": "int4"}}, "model.dtype"),
        ({"kv_transfer": {"backend": "rdma"}}, "kv_transfer.backend"),
        ({"prefill": {"kv_lease_s": 0}}, "kv_lease_s"),
        ({"prefill": {"autoscaling_policy": {"metric": "tpot"}}}, "prefill.autoscaling_policy.metric must be one of queued_tokens, ttft"),
        ({"decode": {"autoscaling_policy": {"target_runing": 4}}}, "decode.autoscaling_policy: unknown key 'target_runing'"),
        ({"decode": {"autoscaling_policy": {"target_kv_usage": 0}}}, "decode.autoscaling_policy.target_kv_usage must be > 0"),
        ({"prefill": {"prefill_kernel": True}}, "prefill.prefill_kernel is gone: model.backend chooses"),
        ({"model": {"backend": "avx"}}, "model.backend must be one of auto, cpu, torch, cuda, not 'avx'"),
        ({"decode": {"engine_nice": 20}}, "decode.engine_nice must be an integer from -20 to 19, not 20"),
        ({"decode": {"engine_nice": "low"}}, "decode.engine_nice must be an integer"),
        ({"router": {"grpc_port": -5}}, "router.grpc_port must be a TCP port from 1 to 65535, not -5"),
        ({"router": {"http_port": 99999}}, "router.http_port must be a TCP port from 1 to 65535, not 99999"),
        ({"router": {"grpc_port": "abc"}}, "router.grpc_port must be a TCP port from 1 to 65535, not 'abc'"),
        ({"router": {"grpc_port": 8000}}, r"router.grpc_port and router.http_port must differ \(both 8000\)"),
        ({"ray": {"metrics_export_port": 0}}, "ray.metrics_export_port must be a TCP port"),
        ({"prefill": {"ray_actor_options": {"num_cpus": "two"}}}, "prefill.ray_actor_options.num_cpus must be a number >= 0, not 'two'"),
        ({"router": {"ray_actor_options": {"num_gpus": -1}}}, "router.ray_actor_options.num_gpus must be a number >= 0, not -1"),
        ({"decode": {"kv_cache_tokens": "lots"}}, "decode.kv_cache_tokens must be a positive integer or null, not 'lots'"),
        ({"decode": {"kv_cache_tokens": "1.5e4"}}, "decode.kv_cache_tokens must be a positive integer"),  # YAML reads 1.5e4 as a string
        ({"prefill": {"kv_cache_tokens": -100}}, "prefill.kv_cache_tokens must be a positive integer or null, not -100"),
        ({"pool_defaults": {"kv_cache_bytes": True}}, "kv_cache_bytes must be a positive integer or null, not True"),
        ({"model": {"max_model_len": -5}}, r"model.max_model_len must be a positive number of tokens or null \(the model's context\), not -5"),
        ({"model": {"max_model_len": 0}}, "model.max_model_len must be a positive number"),
        ({"decode": 5}, "cluster.yaml: decode must be a mapping of keys, not 5"),
        (["mode", "colocated"], "cluster.yaml must be a mapping of sections"),
        ({"decode": {"autoscaling_config": {"min_replicas": 3, "max_replicas": 1}}},
         r"decode.autoscaling_config: Value error, max_replicas \(1\) must be greater than or equal to min_replicas \(3\)!"),
        ({"decode": {"autoscaling_config": {"min_replicas": 1, "bogus_key": 5}}}, "decode.autoscaling_config: unknown key 'bogus_key'"),
        ({"prefill": {"autoscaling_config": "many"}}, "prefill.autoscaling_config must be a mapping"),
        ({"prefill": {"autoscaling_config": {"max_replicas": -2}}}, "prefill.autoscaling_config.max_replicas: "),
    ],
)
def test_bad_config_names_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        ClusterConfig.from_dict(raw)


def test_a_file_that_is_not_yaml_and_a_pool_below_one_block_or_a_context_past_the_models_are_named(tmp_path):
    from transformers import LlamaConfig

    from pdserve.worker import check_pools, max_model_len

    path = tmp_path / "cluster.yaml"
    path.write_text("decode:\n  kv_cache_tokens: [1\n")
    with pytest.raises(ConfigError, match=r"cluster.yaml is not valid YAML: .*line \d+"):
        ClusterConfig.load(path)
    model_config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=512)
    with pytest.raises(ConfigError, match="decode: the KV pool must hold at least one block of 16 tokens"):
        check_pools(ClusterConfig.from_dict({"decode": {"kv_cache_bytes": 10}}), model_config, "float32")
    with pytest.raises(ConfigError, match="model.max_model_len 100000 is more than the model's context of 512 tokens"):
        max_model_len(ClusterConfig.from_dict({"model": {"max_model_len": 100000}}), model_config)
    assert max_model_len(ClusterConfig.from_dict({"model": {"max_model_len": 256}}), model_config) == 256
    assert max_model_len(ClusterConfig(), model_config) == 512


def test_secrets_come_from_the_environment_when_asked(monkeypatch):
    cfg = ClusterConfig.from_dict({"security": {"api_key": "env:PDSERVE_TEST_KEY", "kv_secret": "literal"}})
    monkeypatch.setenv("PDSERVE_TEST_KEY", "from-env")
    assert (cfg.security.resolved().api_key, cfg.security.resolved().kv_secret) == ("from-env", "literal")
    monkeypatch.delenv("PDSERVE_TEST_KEY")
    with pytest.raises(ConfigError, match="PDSERVE_TEST_KEY, which is not set"):
        cfg.security.resolved()


def test_the_kv_secret_is_made_for_each_deployment_unless_turned_off(caplog):
    """null: every deployment gets a random secret of its own, which no log shows; "none" opts
    out, with a warning; a literal is kept."""
    from pdserve_app.deploy import app_config

    caplog.set_level("INFO")
    made = [app_config(ClusterConfig())["security"]["kv_secret"] for _ in range(2)]
    assert all(isinstance(m, str) and len(m) >= 32 for m in made) and made[0] != made[1]
    assert not any(m in caplog.text for m in made)
    assert app_config(ClusterConfig.from_dict({"security": {"kv_secret": "none"}}))["security"]["kv_secret"] is None
    assert "answers anyone" in caplog.text
    assert app_config(ClusterConfig.from_dict({"security": {"kv_secret": "lit"}}))["security"]["kv_secret"] == "lit"


def test_stream_interval_is_a_token_count():
    assert ClusterConfig().decode.stream_interval == 8
    with pytest.raises(ConfigError, match="decode.stream_interval must be an integer from 1 to 64"):
        ClusterConfig.from_dict({"decode": {"stream_interval": 0}})


@pytest.mark.parametrize("raw, message", [
    ({"security": {"api_key": ""}}, "security.api_key"),
    ({"security": {"kv_secret": "env:"}}, "security.kv_secret"),
    ({"router": {"max_in_flight": 0}}, "router.max_in_flight"),
])
def test_bad_security_and_admission_settings_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        ClusterConfig.from_dict(raw)


@pytest.mark.parametrize("raw, cpu_has_bf16, want", [
    ({}, True, "bfloat16"),  # the default, auto, on an AVX512/AMX CPU
    ({}, False, "float32"),  # ... and on an AVX2-only one, where torch's bf16 matmul is a slow fallback
    ({"model": {"dtype": "bfloat16"}}, False, "bfloat16"),  # an explicit dtype is kept
    ({"model": {"dtype": "float32"}}, True, "float32"),
    ({"prefill": {"ray_actor_options": {"num_gpus": 1}}}, False, "bfloat16"),  # GPU pools: bf16
    ({"model": {"device": "cuda"}}, False, "bfloat16"),
    ({"model": {"device": "cpu"}, "prefill": {"ray_actor_options": {"num_gpus": 1}}}, False, "float32"),
])
def test_auto_dtype_is_settled_once_by_where_the_pools_run(monkeypatch, raw, cpu_has_bf16, want):
    from pdserve.engine import cpu
    from pdserve.model_loader import resolve_dtype

    monkeypatch.setattr(cpu, "has_bf16_instructions", lambda: cpu_has_bf16)  # the other CPU kind than this one
    assert resolve_dtype(ClusterConfig.from_dict(raw)) == want


def test_the_app_is_built_with_the_settled_dtype():
    from pdserve_app.deploy import app_config
    from pdserve.engine.cpu import has_bf16_instructions

    assert app_config(ClusterConfig())["model"]["dtype"] == ("bfloat16" if has_bf16_instructions() else "float32")
    assert app_config(ClusterConfig.from_dict({"model": {"dtype": "float16"}}))["model"]["dtype"] == "float16"


def test_the_reference_documents_every_key_of_the_dataclasses_and_no_other():
    """docs/configuration.md names each key as `section.key` (a pool key also as `*.key`),
    and names no key the config does not have."""
    import dataclasses
    import re

    from pdserve.config import POOLS, ROLE_KEYS, ClusterConfig

    doc = (ROOT / "docs" / "configuration.md").read_text()
    named = set(re.findall(r"`((?:\*|[a-z_]+)\.[a-z_]+)`", doc))
    cfg, missing = ClusterConfig(), []
    for section in dataclasses.fields(cfg):
        if section.name == "mode":
            continue
        for key in dataclasses.fields(getattr(cfg, section.name)):
            if section.name in POOLS and section.name not in ROLE_KEYS.get(key.name, POOLS):
                continue  # another role's key
            forms = {f"{section.name}.{key.name}"} | ({f"*.{key.name}", f"pool_defaults.{key.name}"} if section.name in POOLS else set())
            if not forms & named:
                missing.append(f"{section.name}.{key.name}")
    assert not missing, f"docs/configuration.md does not document: {sorted(set(missing))}"
    sections = {f.name for f in dataclasses.fields(cfg)} | {"*", "pool_defaults"}
    pool_keys = {f.name for f in dataclasses.fields(cfg.prefill)}
    unknown = [n for n in named if n.split(".")[0] in sections and n.split(".")[1] not in
               ({f.name for f in dataclasses.fields(getattr(cfg, n.split(".")[0]))} if n.split(".")[0] not in ("*", "pool_defaults") else pool_keys)]
    assert not unknown, f"docs/configuration.md names keys the config does not have: {sorted(unknown)}"


def test_pool_defaults_apply_to_every_pool_under_its_own_section(caplog):
    cfg = ClusterConfig.from_dict({"pool_defaults": {"max_num_seqs": 8, "block_size": 32},
                                   "decode": {"max_num_seqs": 16, "stream_interval": 4}, "prefill": {"kv_lease_s": 5}})
    assert (cfg.prefill.max_num_seqs, cfg.decode.max_num_seqs, cfg.colocated.max_num_seqs) == (8, 16, 8)
    assert cfg.prefill.block_size == cfg.decode.block_size == cfg.colocated.block_size == 32
    assert cfg.decode.max_ongoing_requests == 64 and cfg.prefill.max_ongoing_requests == 32  # built-in role defaults stay
    assert cfg.decode.stream_interval == 4 and cfg.prefill.kv_lease_s == 5
    assert ClusterConfig.from_dict(cfg.to_dict()) == cfg and "pool_defaults" not in cfg.to_dict()


def test_a_role_key_is_refused_in_pool_defaults_and_ignored_with_a_warning_in_another_role(caplog):
    with pytest.raises(ConfigError, match="pool_defaults.kv_lease_s is not shared: set it in prefill"):
        ClusterConfig.from_dict({"pool_defaults": {"kv_lease_s": 5}})
    with caplog.at_level("WARNING", logger="pdserve.config"):
        cfg = ClusterConfig.from_dict({"decode": {"kv_lease_s": 5, "max_num_seqs": 8}, "prefill": {"stream_interval": 2}})
    assert "decode.kv_lease_s is ignored: only prefill use it" in caplog.text
    assert "prefill.stream_interval is ignored: only decode and colocated use it" in caplog.text
    assert cfg.decode.max_num_seqs == 8 and cfg.prefill.kv_lease_s == 30.0


def test_replicas_that_a_fixed_ray_cluster_cannot_place_are_named():
    from pdserve_app.deploy import placement_problem

    two_cpus = {"CPU": 2.0, "memory": 1e10}
    assert placement_problem(ClusterConfig(), two_cpus) is None  # 1 + 1 CPUs, the router none
    assert placement_problem(ClusterConfig.from_dict({"decode": {"ray_actor_options": {"num_cpus": 64}}}), two_cpus) == (
        "decode: a replica needs 64 CPU (ray_actor_options.num_cpus), and this Ray cluster has 2 in all")
    two_each = {"autoscaling_config": {"min_replicas": 2, "max_replicas": 2}, "ray_actor_options": {"num_cpus": 0.5}}
    assert placement_problem(ClusterConfig.from_dict({"prefill": two_each, "decode": two_each}), two_cpus) is None
    assert placement_problem(ClusterConfig.from_dict({"decode": {"ray_actor_options": {"num_cpus": 2}}}), two_cpus) == (
        "the deployments at their min_replicas need 3 CPU together, and this Ray cluster has 2: "
        "lower ray_actor_options.num_cpus or min_replicas")
    assert "resources.prefill_node" in placement_problem(
        ClusterConfig.from_dict({"prefill": {"ray_actor_options": {"num_cpus": 1, "resources": {"prefill_node": 0.5}}}}), two_cpus)
    assert placement_problem(ClusterConfig.from_dict({"mode": "colocated"}), two_cpus) is None  # one pool of 2 CPUs
    tp2 = {"tensor_parallel_size": 2}  # a replica holds the actor's resources once per rank
    assert placement_problem(ClusterConfig.from_dict({"prefill": tp2}), two_cpus) == (
        "the deployments at their min_replicas need 3 CPU together, and this Ray cluster has 2: "
        "lower ray_actor_options.num_cpus or min_replicas")
    assert placement_problem(ClusterConfig.from_dict({"prefill": {**tp2, "ray_actor_options": {"num_cpus": 0.5}}}), two_cpus) is None
    assert "needs 4 CPU (ray_actor_options.num_cpus x tensor_parallel_size)" in placement_problem(
        ClusterConfig.from_dict({"decode": {"tensor_parallel_size": 4}}), two_cpus)


def test_a_tensor_parallel_pool_is_one_strictly_packed_placement_group_of_a_bundle_per_rank():
    from pdserve_app.deploy import _pool_options

    cfg = ClusterConfig.from_dict({"prefill": {"tensor_parallel_size": 3, "ray_actor_options": {"num_cpus": 2, "resources": {"node_a": 0.1}}}})
    options = _pool_options("prefill", cfg.prefill)
    assert options["placement_group_bundles"] == [{"CPU": 2, "node_a": 0.1}] * 3 and options["placement_group_strategy"] == "STRICT_PACK"
    assert "placement_group_bundles" not in _pool_options("decode", cfg.decode)
    with pytest.raises(ConfigError, match="prefill.tensor_parallel_size must be an integer from 1 to 64"):
        ClusterConfig.from_dict({"prefill": {"tensor_parallel_size": 0}})
