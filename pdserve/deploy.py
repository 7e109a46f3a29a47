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

from ray import serve
from ray.serve.config import gRPCOptions

from pdserve.autoscaling import ray_policy
from pdserve.config import KV_SECRET_OFF, ClusterConfig, ConfigError, PoolConfig

log = logging.getLogger(__name__)

APP_NAME = "pdserve"


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
    }


def holder_router_config():
    """Ray Serve's request router for a pool whose calls by request id (decode's abort,
    prefill's release) must reach the replica holding the request: router/holder_routing.py."""
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class="router.holder_routing.HolderAwareRouter")


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
        name="router",
        num_replicas=cfg.router.num_replicas,
        max_ongoing_requests=cfg.router.max_ongoing_requests,
        ray_actor_options=dict(cfg.router.ray_actor_options),
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


def deploy(cfg: ClusterConfig) -> None:
    """Deploy (or update) the pdserve app on the connected Ray cluster; returns once it is running."""
    start_serve(cfg)
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
