"""The local Ray head that `pdserve up` starts, and how far it is closed to the network.

pdserve's own servers listen on loopback on a single node: the client APIs (``router.host``),
the KV servers (``kv_transfer.bind_host``). Ray 2.60 cannot be held to loopback:
``ray start --node-ip-address 127.0.0.1`` replaces the address with the machine's
(``services.resolve_ip_for_localhost``), and the GCS, the raylet, every worker's gRPC server
and Ray Serve's inter-deployment server bind all interfaces in Ray's code. So the head runs
with Ray's token authentication (``RAY_AUTH_MODE=token``): every Ray gRPC and agent HTTP
endpoint then refuses a caller without the token (UNAUTHENTICATED / 401); the Prometheus
metrics endpoints stay open, read-only. The token is Ray's default file,
``~/.ray/auth_token``, generated here (mode 0600) if it is missing, so every Ray client of
this user on this machine (``ray status``, ``ray.init``, `pdserve down`) finds it. A
``RAY_AUTH_MODE`` set in the environment wins (``disabled``: `up` says what that exposes).
docs/operations.md lists the ports.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

TOKEN_PATH = Path.home() / ".ray" / "auth_token"  # Ray's default token file


def ray_cli() -> str:
    """The ``ray`` command of this Python environment (else the one on PATH)."""
    local = Path(sys.executable).parent / "ray"
    return str(local) if local.exists() else "ray"


def ensure_token(path: Path = TOKEN_PATH) -> Path | None:
    """The token file the head will use, created (32 random bytes, hex; mode 0600) if missing
    and narrowed to 0600 if it was readable by others. None where the environment decides
    (``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH`` set: Ray reads those first)."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return None
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def start_head(metrics_export_port: int) -> str:
    """``ray start --head`` on this machine, with token authentication unless the environment
    turns it off. Returns the line `up` prints about it. Raises subprocess.CalledProcessError
    if Ray does not start."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        said = (f"Ray token authentication is off (RAY_AUTH_MODE={mode}): anyone who reaches this machine's Ray ports "
                "(GCS 6379, the raylet's and the workers') can run code on it")
    else:
        # with RAY_AUTH_MODE unset and a token present, Ray turns token authentication on for
        # `ray start --head` and for every client that joins it (ray.init(address="auto"))
        token = ensure_token()
        said = f"Ray token authentication is on (token in {token or 'RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH'}" + (", mode 0600)" if token else ")")
    # Ray starts its workers at nice 15 by default: the replicas and Serve's proxy (on every
    # request's path) would yield their cores to any other process on the node, a load
    # generator for one. The whole node at 0 keeps Serve's controller level with the replicas
    # too (a controller left at 15 behind busy replicas stops autoscaling).
    # Serve's controller runs its control loop every 0.1 s by default: ~5% of a core on a node
    # of 2, taken from the replicas. Every 0.5 s it takes ~2%; a dead replica or a scaling
    # decision is acted on up to 0.4 s later. An explicit setting in the environment wins.
    env = {**os.environ, "RAY_worker_niceness": os.environ.get("RAY_worker_niceness", "0"),
           "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": os.environ.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")}
    subprocess.run(
        [ray_cli(), "start", "--head", "--disable-usage-stats", "--include-dashboard=false", "--dashboard-host=127.0.0.1",
         f"--num-cpus={os.cpu_count()}", f"--metrics-export-port={metrics_export_port}"],
        check=True, stdout=subprocess.DEVNULL, env=env,
    )
    return said
