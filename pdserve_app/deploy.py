"""Build and run the Ray Serve application from a ClusterConfig.

Disaggregated (the default): three deployments, ``prefill`` and ``decode`` (each its own
replicas, resources and autoscaling from cluster.yaml) and the ``router`` ingress, reached
through Ray Serve's gRPC and HTTP proxies. Colocated (``mode: colocated``): ``colocated``
(one pool running both phases, the same engine) and the router.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time

from ray import serve
from ray.serve.config import gRPCOptions

from pdserve.autoscaling import ray_policy
from pdserve.config import KV_SECRET_OFF, ClusterConfig, ConfigError, PoolConfig

log = logging.getLogger(__name__)

APP_NAME = "pdserve"
ROUTER_DEPLOYMENT = "router"


def _pool_options(name: str, pool: PoolConfig) -> dict:
    autoscaling = dict(pool.autoscaling_config)
    autoscaling.setdefault("policy", ray_policy(name, pool.autoscaling_policy))  # pdserve's signals unless a policy is given
    return {
        "name": name,
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": pool.max_ongoing_requests,
        "max_queued_requests": pool.max_queued_requests,
        "graceful_shutdown_timeout_s": pool.graceful_shutdown_timeout_s,
        "health_check_period_s": pool.health_check_period_s,
        "health_check_timeout_s": pool.health_check_timeout_s,
        "ray_actor_options": dict(pool.ray_actor_options),
        **_rank_bundles(pool),
    }


def _rank_bundles(pool: PoolConfig) -> dict:
    """A tensor-parallel replica's placement group: one bundle of the pool's actor resources
    per rank, all on one node (STRICT_PACK). Rank 0, the replica's actor, takes the first;
    ranks 1 .. n-1 are actors it starts in the others (tensor_parallel/launch.py). Empty at TP=1."""
    if pool.tensor_parallel_size == 1:
        return {}
    actor = pool.ray_actor_options
    bundle = {"CPU": actor.get("num_cpus", 1), **({"GPU": actor["num_gpus"]} if actor.get("num_gpus") else {}), **(actor.get("resources") or {})}
    return {"placement_group_bundles": [dict(bundle) for _ in range(pool.tensor_parallel_size)], "placement_group_strategy": "STRICT_PACK"}


def holder_router_config():
    """Ray Serve's request router for a pool whose calls by request id (decode's abort,
    prefill's release) must reach the replica holding the request: router/holder_routing.py."""
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class="router.holder_routing.HolderAwareRouter")


def replica_router_config():
    """Ray Serve's request router for the router deployment: a call can name its replica
    (``pdserve down`` drains each one), router/replica_calls.py."""
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class="router.replica_calls.ReplicaTargetRouter")


def prefix_router_config(pool: PoolConfig):
    """Ray Serve's request router for the prefill pool: router/prefix_routing.py (which also
    sends releases by id to their holder), told the pool's block size and (roughly) its KV
    pool in blocks."""
    from ray.serve.config import RequestRouterConfig

    tokens = pool.kv_cache_tokens or 32768
    return RequestRouterConfig(request_router_class="router.prefix_routing.PrefixAwareRouter",
                               request_router_kwargs={"block_size": pool.block_size, "capacity_blocks": max(1, tokens // pool.block_size)})


def app_config(cfg: ClusterConfig) -> dict:
    """The cluster.yaml mapping every deployment of the app is built with: ``cfg`` with what
    must be settled once, where pdserve is deployed from: secrets given as "env:NAME", the
    KV channel's secret when none is set (a random one per deployment), and ``model.dtype:
    auto`` (both pools must load the same dtype; ``resolve_dtype``)."""
    from pdserve.model_loader import resolve_dtype

    config = cfg.to_dict()
    config["security"] = dataclasses.asdict(cfg.security.resolved())
    if cfg.security.kv_secret is None:  # secure by default: a secret of this deployment's own, in no log
        config["security"]["kv_secret"] = secrets.token_urlsafe(32)
    elif cfg.security.kv_secret == KV_SECRET_OFF:
        log.warning("security.kv_secret is %r: the KV channel between the pools answers anyone who reaches its port", KV_SECRET_OFF)
    config["model"]["dtype"] = resolve_dtype(cfg)
    return config


def build_app(cfg: ClusterConfig) -> serve.Application:
    from decode_worker import DecodeServer
    from prefill_worker import PrefillServer
    from router import Router

    config = app_config(cfg)
    if cfg.mode == "colocated":
        prefill = None
        decode = serve.deployment(DecodeServer).options(**_pool_options("colocated", cfg.colocated),
                                                        request_router_config=holder_router_config()).bind(config, "colocated")
    else:
        options = _pool_options("prefill", cfg.prefill)
        options["request_router_config"] = prefix_router_config(cfg.prefill) if cfg.router.prefix_routing else holder_router_config()
        prefill = serve.deployment(PrefillServer).options(**options).bind(config)
        decode = serve.deployment(DecodeServer).options(**_pool_options("decode", cfg.decode),
                                                        request_router_config=holder_router_config()).bind(config)
    router = serve.deployment(Router).options(
        name=ROUTER_DEPLOYMENT,
        num_replicas=cfg.router.num_replicas,
        max_ongoing_requests=cfg.router.max_ongoing_requests,
        ray_actor_options=dict(cfg.router.ray_actor_options),
        request_router_config=replica_router_config(),
    )
    return router.bind(prefill, decode, config)


def app_builder(args: dict) -> serve.Application:
    """Ray Serve application builder, for ``serve deploy`` and KubeRay (``pdserve render``):
    ``args`` = {"config": a cluster.yaml mapping}. Raises ConfigError for a bad config."""
    return build_app(ClusterConfig.from_dict((args or {}).get("config")))


def http_tls(cfg: ClusterConfig) -> dict:
    """Ray Serve's HTTPOptions for ``router.tls_*`` (HTTPS on its proxies), {} without TLS."""
    r = cfg.router
    if not r.tls_cert_file:
        return {}
    return {"ssl_certfile": r.tls_cert_file, "ssl_keyfile": r.tls_key_file, **({"ssl_ca_certs": r.tls_client_ca_file} if r.tls_client_ca_file else {})}


def start_serve(cfg: ClusterConfig) -> None:
    """Start Ray Serve's HTTP proxies on ``router.host:router.http_port``. Its gRPC proxy stays
    off: each router replica serves the gRPC API itself (router/grpc_server.py).

    Raises ConfigError where Serve already runs with its HTTP proxies on another host or port:
    Serve applies ``http_options`` only when it starts, and would keep the old ones silently."""
    running = _running_http()
    wanted = (cfg.router.host, cfg.router.http_port)
    if running is not None and running != wanted:
        raise ConfigError(f"Ray Serve already serves HTTP on {running[0]}:{running[1]}, and router.host / router.http_port "
                          f"({wanted[0]}:{wanted[1]}) apply only when it starts: `pdserve down`, then `pdserve up`")
    serve.start(
        proxy_location=cfg.router.proxy_location,
        http_options={"host": cfg.router.host, "port": cfg.router.http_port, **http_tls(cfg)},
        grpc_options=gRPCOptions(port=cfg.router.grpc_port, grpc_servicer_functions=[]),
    )


def _running_http() -> tuple[str, int] | None:
    """(host, port) of the HTTP proxies of the Ray Serve running on the connected cluster, or
    None where none runs (or this Ray's Serve does not say: its client is Serve's private API)."""
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client(raise_if_no_controller_running=False)
        return None if client is None else (client.http_config.host, int(client.http_config.port))
    except Exception:  # noqa: BLE001 - another Ray version's internals: skip the check
        return None


_ACTOR_KEY = {"CPU": "num_cpus", "GPU": "num_gpus"}  # ray_actor_options' key of a Ray resource


def placement_problem(cfg: ClusterConfig, total: dict[str, float]) -> str | None:
    """Why the app's replicas cannot all be placed on a Ray cluster of fixed resources
    ``total`` (``ray.cluster_resources()``: "CPU", "GPU" and custom ones), or None: a replica
    asking for more of one than the whole cluster has, or every deployment at its
    ``min_replicas`` (the router at ``num_replicas``) asking for more CPUs or GPUs together."""
    pools = ("colocated",) if cfg.mode == "colocated" else ("prefill", "decode")
    sections = [("router", cfg.router.ray_actor_options, cfg.router.num_replicas, 1)]
    sections += [(name, getattr(cfg, name).ray_actor_options, getattr(cfg, name).autoscaling_config.get("min_replicas", 1),
                  getattr(cfg, name).tensor_parallel_size) for name in pools]
    together = {"CPU": 0.0, "GPU": 0.0}
    for name, actor, replicas, ranks in sections:  # a tensor-parallel replica holds the actor's resources once per rank
        demand = {"CPU": actor.get("num_cpus", 1) * ranks, "GPU": actor.get("num_gpus", 0) * ranks,
                  **{k: v * ranks for k, v in (actor.get("resources") or {}).items()}}
        for resource, amount in demand.items():
            if amount and amount > total.get(resource, 0):
                key = _ACTOR_KEY.get(resource, f"resources.{resource}")
                return (f"{name}: a replica needs {amount:g} {resource} (ray_actor_options.{key}{' x tensor_parallel_size' if ranks > 1 else ''}), "
                        f"and this Ray cluster has {total.get(resource, 0):g} in all")
        for resource in together:
            together[resource] += demand[resource] * replicas
    for resource, amount in together.items():
        if amount > total.get(resource, 0) + 1e-9:
            return (f"the deployments at their min_replicas need {amount:g} {resource} together, and this Ray cluster "
                    f"has {total.get(resource, 0):g}: lower ray_actor_options.{_ACTOR_KEY[resource]} or min_replicas")
    return None


class DeployStuckError(TimeoutError):
    """The app did not reach RUNNING: past the deadline, or with replicas that cannot be placed."""


UNSCHEDULABLE = "to be scheduled"  # in Ray Serve's status message for a replica pending allocation for over 30 s


def deploy(cfg: ClusterConfig, timeout_s: float = 900.0, fixed_resources: bool = False, poll_s: float = 1.0) -> None:
    """Deploy (or update) the pdserve app on the connected Ray cluster; returns once it is running.

    Raises RuntimeError when Ray Serve gives up on it (DEPLOY_FAILED: a replica's constructor
    failed its retries), DeployStuckError after ``timeout_s`` seconds not running, or, with
    ``fixed_resources`` (a Ray head with no autoscaler, as the one ``pdserve up`` starts),
    as soon as Serve reports a replica that cannot be placed (its message names the
    resources a replica needs and those available)."""
    start_serve(cfg)
    serve.run_many([serve.RunTarget(build_app(cfg), name=APP_NAME, route_prefix="/")],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(APP_NAME)
        status = app.status if app is not None else "NOT_STARTED"
        if status == "RUNNING":  # and, as serve.run does, until the proxies route to it
            from ray.serve.context import _get_global_client

            _get_global_client().wait_for_proxies_serving(wait_for_applications_running=True)
            return
        if status == "DEPLOY_FAILED":
            raise RuntimeError(f"Deploying application {APP_NAME} failed: {app.message}")
        waiting = {name: " ".join(d.message.split()) for name, d in (app.deployments.items() if app else ()) if d.message}
        stuck = {name: m for name, m in waiting.items() if UNSCHEDULABLE in m}
        if fixed_resources and stuck:
            raise DeployStuckError("; ".join(f"{name}: {m}" for name, m in stuck.items()))
        if time.monotonic() > deadline:
            raise DeployStuckError(f"not running after {timeout_s:.0f} s (status {status}): " + ("; ".join(f"{n}: {m}" for n, m in waiting.items()) or "no message from Ray Serve"))
        time.sleep(poll_s)
