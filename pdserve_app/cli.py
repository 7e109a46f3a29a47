"""The ``pdserve`` command: up, down, generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from pdserve.client import DEFAULT_ENDPOINT, Client
from pdserve.config import ClusterConfig, cache_root

app = typer.Typer(
    help="pdserve: disaggregated prefill/decode LLM serving on Ray Serve.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)

MODEL_HELP = "model to serve (overrides model.path): 'smollm2', a Hugging Face model directory or a .gguf path"
STATE_FILE = "cluster-state.json"  # under the cache root: what `up` started


def _state_path() -> Path:
    return cache_root() / STATE_FILE


def _read_state() -> dict:
    try:
        return json.loads(_state_path().read_text())
    except (OSError, ValueError):
        return {}


def _connect_ray(address: str | None, metrics_export_port: int = 8080) -> bool:
    """Join ``address`` (or a running local cluster), else start a local head (its Prometheus
    metrics on ``metrics_export_port``; token authentication: pdserve_app/ray_head.py). True
    if we started it."""
    import ray

    from pdserve_app.ray_head import start_head

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    try:
        ray.init(address="auto", log_to_driver=False)
        return False
    except ConnectionError:
        pass
    typer.echo("Starting a local Ray head node ...", err=True)
    typer.echo(start_head(metrics_export_port), err=True)
    ray.init(address="auto", log_to_driver=False)
    return True


def _replica_failure() -> str | None:
    """Why the app's deployments failed, from Ray Serve's status: each failed deployment's
    name and the last line of its replicas' error (Ray's own message names neither)."""
    try:
        from ray import serve

        from pdserve_app.deploy import APP_NAME

        app = serve.status().applications.get(APP_NAME)
        failed = {name: d.message for name, d in (app.deployments.items() if app else ()) if d.status not in ("HEALTHY", "UPDATING", "UPSCALING", "DOWNSCALING")}
    except Exception:  # noqa: BLE001 - the status is a nicety: Ray's own message stands without it
        return None
    lines = [f"{name}: {next((x.strip() for x in reversed(message.splitlines()) if x.strip()), '?')}" for name, message in failed.items()]
    return "; ".join(lines)[:2000] or None


def _up(config: Path | None, address: str | None, model: str | None = None, redeploy: bool = False, timeout_s: float = 900.0) -> str:
    from pdserve_app.deploy import DeployStuckError, deploy
    from pdserve.model_loader import resolve_model_dir

    from pdserve.config import ConfigError
    from pdserve.model_loader import ModelNotFoundError

    try:
        cfg = ClusterConfig.load(config)
        if model:
            cfg.model.path = model
            cfg.validate()
    except (OSError, ConfigError) as e:
        raise _fail(str(e))
    host = "127.0.0.1" if cfg.router.host in ("0.0.0.0", "::", "") else cfg.router.host
    endpoint = f"{host}:{cfg.router.grpc_port}"
    # with TLS, probe it trusting the served certificate (a self-signed one verifies so) or PDSERVE_TLS_CA_FILE
    tls_ca = os.environ.get("PDSERVE_TLS_CA_FILE") or cfg.router.tls_cert_file
    if not redeploy and _healthy(endpoint, tls_ca):
        typer.echo(f"pdserve is already up at {endpoint} (use --redeploy to apply a changed config).", err=True)
        return endpoint
    typer.echo(f"Preparing model {cfg.model.path!r} (a GGUF is converted once into {cache_root()}) ...", err=True)
    try:
        model_dir = resolve_model_dir(cfg.model.path)
    except ModelNotFoundError as e:
        raise _fail(str(e))
    from pdserve.model_loader import resolve_dtype

    dtype = resolve_dtype(cfg)
    how = " (model.dtype: auto, settled for this machine)" if cfg.model.dtype == "auto" else ""
    typer.echo(f"Model ready at {model_dir}; the pools load it in {dtype}{how}", err=True)
    try:  # what a replica would refuse, refused here in one line before anything starts
        from transformers import AutoConfig

        from pdserve.worker import check_pools

        check_pools(cfg, AutoConfig.from_pretrained(model_dir), dtype)
    except ConfigError as e:
        raise _fail(str(e))
    started_now = _connect_ray(address or cfg.ray.address, cfg.ray.metrics_export_port)
    started_ray = started_now or _read_state().get("started_ray", False)
    _state_path().parent.mkdir(parents=True, exist_ok=True)
    _state_path().write_text(json.dumps({"endpoint": endpoint, "started_ray": started_ray}))  # an interrupted `up`: `down` stops the head
    pools = "a colocated pool" if cfg.mode == "colocated" else "prefill and decode pools"
    typer.echo(f"Deploying the router and {pools} (each replica loads the model) ...", err=True)
    start = time.perf_counter()
    if started_ray:  # a head `up` started has no autoscaler: what cannot be placed now never will be
        import ray

        from pdserve_app.deploy import placement_problem

        problem = placement_problem(cfg, ray.cluster_resources())
        if problem:
            if started_now:
                _stop_ray()
                _state_path().unlink(missing_ok=True)
                problem += " (the Ray head this `up` started is stopped)"
            raise _fail(problem)
    try:
        deploy(cfg, timeout_s=timeout_s, fixed_resources=started_ray)
    except Exception as e:  # noqa: BLE001 - a replica refused to start, a port in use, ...: say why, leave nothing behind
        stuck = isinstance(e, DeployStuckError)
        reason = (None if stuck else _replica_failure()) or " ".join(str(e).split())[:2000] or type(e).__name__
        if started_now:
            _stop_ray()
            _state_path().unlink(missing_ok=True)
            reason += " (the Ray head this `up` started is stopped)"
        elif stuck:
            reason += " (the cluster is left as Ray Serve has it: fix the config and `pdserve up --redeploy` it, or `pdserve down`)"
        raise _fail(f"deploy failed: {reason}", code=1)
    typer.echo(f"Deployed in {time.perf_counter() - start:.1f}s.", err=True)
    return endpoint


@app.command()
def up(
    config: Optional[Path] = typer.Argument(None, help="cluster.yaml; default: the embedded default"),
    address: Optional[str] = typer.Option(None, help="Ray cluster to join (overrides ray.address)"),
    model: Optional[str] = typer.Option(None, help=MODEL_HELP),
    redeploy: bool = typer.Option(False, help="redeploy even if pdserve already answers (restarts replicas)"),
    timeout_s: float = typer.Option(900.0, help="give up (exit 1) if the app is not running after this many seconds"),
):
    """Start Ray (or join a cluster), deploy the pools and router, print the endpoint.

    If pdserve already answers on the configured port, nothing is restarted. On a Ray head
    that `up` started, replicas that cannot be placed (more CPUs than the machine has) fail
    the deploy once Ray Serve reports them (after ~30 s).
    """
    endpoint = _up(config, address, model, redeploy, timeout_s)
    typer.echo(f"pdserve is up. gRPC endpoint: {endpoint}")


DOWN_TIMEOUT_S = 60.0  # each step of `down` (Serve's shutdown, `ray stop`) gets this long
_SERVE_SHUTDOWN = """
import sys, ray
from ray import serve
try:
    ray.init(address="auto", log_to_driver=False)
except ConnectionError:
    sys.exit(3)
serve.shutdown()
"""


def _stop_ray() -> bool:
    """``ray stop`` on this node (``--force`` if it has not finished in DOWN_TIMEOUT_S), then the
    /dev/shm KV pools of prefill replicas killed before they could remove them; True if it ran."""
    from kv_transfer.factory import remove_stale_pool_files
    from pdserve_app.ray_head import ray_cli

    for args in (["stop"], ["stop", "--force"]):
        try:
            subprocess.run([ray_cli(), *args], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=DOWN_TIMEOUT_S)
            remove_stale_pool_files()
            return True
        except subprocess.TimeoutExpired:
            typer.echo(f"`ray {' '.join(args)}` did not finish in {DOWN_TIMEOUT_S:.0f} s", err=True)
    return False


def _drain(drain_s: float) -> None:
    """Drain every router replica (pdserve_app/drain.py, in a child process) and say how it went."""
    from router.draining import CLOSE_DEADLINE_S

    try:
        done = subprocess.run([sys.executable, "-m", "pdserve_app.drain", f"{drain_s:g}"], capture_output=True, text=True,
                              timeout=drain_s + CLOSE_DEADLINE_S + DOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        typer.echo(f"The drain did not finish in {drain_s + CLOSE_DEADLINE_S + DOWN_TIMEOUT_S:.0f} s; going on", err=True)
        return
    if done.returncode == 3:
        return  # nothing to drain: no cluster, or no app (the next step says which)
    if done.returncode != 0:
        typer.echo(f"The drain failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}; going on", err=True)
        return
    c = json.loads(done.stdout.strip().splitlines()[-1])
    typer.echo(f"Drained {c['replicas']} router replica(s): of {c['in_flight']} requests in flight, {c['finished']} finished "
               f"within {drain_s:g} s and {c['cut']} ended with an error" + (f"; {c['unanswered']} replica(s) did not answer" if c["unanswered"] else ""),
               err=True)


@app.command()
def down(
    drain_s: float = typer.Option(30.0, "--drain-s", min=0.0,
                                  help="seconds in-flight requests get to finish (new ones are refused with 503 / UNAVAILABLE); "
                                       "the rest then end with an error"),
):
    """Drain the router replicas, then stop the pdserve app, and the local Ray head if
    `pdserve up` started it. Each step has a deadline; it prints what it stopped."""
    state = _read_state()
    _drain(drain_s)
    try:  # in a child process: joining a cluster whose head is gone can wait for minutes
        done = subprocess.run([sys.executable, "-c", _SERVE_SHUTDOWN], capture_output=True, text=True, timeout=DOWN_TIMEOUT_S)
        if done.returncode == 0:
            typer.echo("Stopped the pdserve app (Ray Serve).", err=True)
        elif done.returncode == 3:
            typer.echo("No running Ray cluster found.", err=True)
        else:
            typer.echo(f"Ray Serve's shutdown failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}", err=True)
    except subprocess.TimeoutExpired:
        typer.echo(f"Ray Serve's shutdown did not finish in {DOWN_TIMEOUT_S:.0f} s; going on", err=True)
    if state.get("started_ray") and _stop_ray():
        typer.echo("Stopped the local Ray head that `pdserve up` started.", err=True)
    _state_path().unlink(missing_ok=True)
    typer.echo("pdserve is down.")


def _healthy(endpoint: str, tls_ca_file: str | None = None) -> bool:
    import grpc

    with Client(endpoint, tls_ca_file=tls_ca_file) as client:
        try:
            client.health(timeout_s=3)
            return True
        except grpc.RpcError:
            return False


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="user message (chat template applied) or, with --raw, plain text"),
    endpoint: Optional[str] = typer.Option(None, help="router gRPC address; default: the one `up` printed"),
    max_tokens: int = typer.Option(128, help="tokens to generate"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    seed: Optional[int] = typer.Option(None),
    raw: bool = typer.Option(False, help="send the prompt as plain text, without the chat template"),
    tls_ca_file: Optional[str] = typer.Option(None, envvar="PDSERVE_TLS_CA_FILE",
                                              help="connect over TLS, verifying the server against this CA (router.tls_*)"),
    local: bool = typer.Option(False, help="bring up the embedded default if nothing is running"),
    config: Optional[Path] = typer.Option(None, help="cluster.yaml used by --local"),
    model: Optional[str] = typer.Option(None, help=MODEL_HELP + "; used by --local"),
):
    """Stream an answer, then print TTFT, TPOT and token counts."""
    import grpc

    from pdserve.client import build_request

    params = {"max_tokens": max_tokens, "temperature": temperature}
    if seed is not None:
        params["seed"] = seed
    request = {"prompt": prompt} if raw else {"messages": [{"role": "user", "content": prompt}]}
    try:
        build_request(**request, **params)  # out of the protobuf fields' range: one line, before anything starts
    except (TypeError, ValueError) as e:
        raise _fail(str(e))
    endpoint = endpoint or _read_state().get("endpoint", DEFAULT_ENDPOINT)
    if local or config or model:
        if _healthy(endpoint, tls_ca_file):
            if config or model:
                typer.echo(f"note: pdserve already answers at {endpoint}, so --config/--model are not applied "
                           "(`pdserve up --redeploy` applies them)", err=True)
        elif local:
            endpoint = _up(config, None, model)
    start = time.perf_counter()
    first_at = last_at = None
    num_tokens, finish, num_prompt = 0, "", 0
    try:
        with Client(endpoint, tls_ca_file=tls_ca_file) as client:
            for chunk in client.stream(**request, **params):
                now = time.perf_counter()
                if chunk.token_ids:
                    first_at = first_at or now
                    last_at = now
                num_tokens += len(chunk.token_ids)
                finish, num_prompt = chunk.finish_reason or finish, chunk.prompt_tokens
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except grpc.RpcError as e:
        typer.echo(f"\nerror: {e.code().name}: {e.details()}", err=True)
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            typer.echo("Is pdserve running? Start it with `pdserve up`, or use --local. If it serves TLS "
                       "(router.tls_*), pass --tls-ca-file.", err=True)
        raise typer.Exit(1)
    sys.stdout.write("\n")
    ttft = f"{(first_at - start) * 1e3:.0f} ms" if first_at else "n/a"
    tpot = f"{(last_at - first_at) / (num_tokens - 1) * 1e3:.1f} ms" if num_tokens > 1 else "n/a"
    typer.echo(
        f"[TTFT {ttft} | TPOT {tpot} | prompt {num_prompt} tokens | output {num_tokens} tokens | finish {finish}]",
        err=True,
    )


render_app = typer.Typer(help="Deployment files generated from a cluster.yaml.", no_args_is_help=True)
app.add_typer(render_app, name="render")


def _render_config(config: Optional[Path]) -> ClusterConfig:
    from pdserve.config import ConfigError

    try:
        return ClusterConfig.load(config)
    except (OSError, ConfigError) as e:
        raise _fail(str(e))


@render_app.command("serve")
def render_serve(config: Optional[Path] = typer.Argument(None, help="cluster.yaml; default: the embedded default")):
    """A Ray Serve config for `serve deploy` (pools pinned to their node groups' resources)."""
    from pdserve_app.render import dump, serve_config

    typer.echo(dump(serve_config(_render_config(config))), nl=False)


@render_app.command("kuberay")
def render_kuberay(
    config: Optional[Path] = typer.Argument(None, help="cluster.yaml; default: the embedded default"),
    image: str = typer.Option("pdserve:latest", help="container image with pdserve installed"),
    secret_name: str = typer.Option("pdserve-secrets", help="Kubernetes Secret holding the \"env:NAME\" secrets of cluster.yaml, one key per NAME"),
):
    """A KubeRay RayService manifest: head group + one worker group per pool."""
    import ray

    from pdserve_app.render import dump, kuberay

    typer.echo(dump(kuberay(_render_config(config), image, ray.__version__, secret_name)), nl=False)


def _bench(name: str):
    """``bench.<name>`` from the pdserve checkout this package runs from: bench/ is not in
    the wheel. Exits with a clear error where there is no checkout."""
    import importlib

    root = Path(__file__).resolve().parents[1]
    if (root / "bench" / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        return importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("bench", f"bench.{name}"):
            raise
        raise _fail(f"`pdserve bench` and `pdserve tune` run from a pdserve checkout (bench/ is not in the wheel); none at {root}")


bench_app = typer.Typer(help="Benchmarks against a running endpoint.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def bench_serve(ctx: typer.Context) -> None:
    """Load-test any OpenAI-compatible endpoint (TTFT, TPOT, ITL, SLO attainment); --help for options."""
    import argparse

    bench_serve_module = _bench("serve")

    parser = argparse.ArgumentParser(prog="pdserve bench serve", description=bench_serve_module.__doc__.split("\n\n")[0])
    bench_serve_module.add_arguments(parser)
    bench_serve_module.main(parser.parse_args(ctx.args))


@bench_app.command("goodput", context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def bench_goodput(ctx: typer.Context) -> None:
    """Highest request rate meeting both SLOs for 90% of requests (rate sweep); --help for options."""
    _bench("goodput").main(ctx.args)


@app.command("tune", context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def tune(ctx: typer.Context) -> None:
    """Recommend the prefill:decode split for a workload and SLOs (profile + simulation); --help for options."""
    _bench("tune").main(ctx.args)


if __name__ == "__main__":
    app()
