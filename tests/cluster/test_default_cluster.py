"""The cluster `pdserve up` starts on the embedded default, as a user runs it: closed to the
network (pdserve's servers on loopback, Ray's behind its token); a router replica killed mid-stream leaves no work in the
pools; `pdserve down` drains (streams that finish in time get all of their output, the rest
an error, new requests a 503 / UNAVAILABLE with a retry hint). The tests run in this order,
on one cluster."""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from pdserve.client import Client
from test_cli import pdserve as pdserve_with_test_env

pytestmark = pytest.mark.e2e

GRPC_PORT, HTTP_PORT = 9140, 8140
SHORT, DRAIN_S = 200, 20  # a short stream is running when the drain begins (some seconds after it starts) and finishes within it
HANG_S = 120.0  # deadlines below only catch hangs


def user_env() -> dict[str, str]:
    """This process's environment as a user's: without the suite's RAY_AUTH_MODE=disabled
    (tests/conftest.py), so `up` starts Ray as it would for them. Ray caches the mode per
    process, so everything that talks to this cluster's Ray runs in a child (``in_ray``)."""
    return {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}


def pdserve(*args: str, timeout: float = 600):
    saved = os.environ.pop("RAY_AUTH_MODE", None)
    try:
        return pdserve_with_test_env(*args, timeout=timeout)
    finally:
        if saved is not None:
            os.environ["RAY_AUTH_MODE"] = saved


def in_ray(code: str):
    """Run ``code`` (Python; it sets ``result``) in a child joined to the cluster; returns ``result`` (JSON)."""
    script = ("import json, ray\nfrom ray import serve\nray.init(address='auto', log_to_driver=False)\n"
              f"{code}\nprint('RESULT ' + json.dumps(result))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S, env=user_env())
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][7:])


def pools_stats() -> dict[str, dict]:
    return in_ray("result = {p: serve.get_deployment_handle(p, 'pdserve').stats.remote().result(timeout_s=30) for p in ('prefill', 'decode')}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = tmp_path_factory.mktemp("default") / "cluster.yaml"
    config.write_text(f"model:\n  dtype: float32\nrouter:\n  grpc_port: {GRPC_PORT}\n  http_port: {HTTP_PORT}\n")
    up = pdserve("up", str(config))
    assert up.returncode == 0, up.stderr[-3000:]
    state = {"up": up, "down": None}
    try:
        yield state
    finally:
        if state["down"] is None:
            pdserve("down", "--drain-s", "0")


def ray_processes() -> dict[int, str]:
    """pid -> command line of every process of the Ray cluster (Ray's own and its workers)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "ray" in cmdline.split(" ")[0] or "/ray/" in cmdline or cmdline.startswith("ray::"):
            found[int(proc.name)] = cmdline.strip()
    return found


def listening_sockets(pids) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state that one of ``pids`` holds."""
    import ipaddress

    inodes = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(":")
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                raw = bytes.fromhex(address)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
                ip = ipaddress.ip_address(raw)
                found.append((str(getattr(ip, "ipv4_mapped", None) or ip), int(port, 16), inodes[fields[9]]))
    return found


# a method each kind of Ray gRPC server implements (one it lacks answers UNIMPLEMENTED before
# any authentication): GCS, a worker's core worker, the raylet's node and object managers,
# the dashboard agent, Ray Serve's inter-deployment server, the Ray client server
RAY_GRPC_METHODS = ("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.CoreWorkerService/NumPendingTasks",
                    "/ray.rpc.NodeManagerService/GetNodeStats", "/ray.rpc.ObjectManagerService/Push", "/ray.rpc.ReporterService/GetTraceback",
                    "/ray.serve.ASGIService/HandleRequest", "/ray.rpc.RayletDriver/ClusterInfo")


def without_token(host: str, port: int) -> str:
    """How the server at ``host:port`` answers a caller without Ray's token: "HTTP <status>"
    (with "metrics" for Prometheus text), or the gRPC status of the first of RAY_GRPC_METHODS
    it implements ("UNIMPLEMENTED" if none)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
            return f"HTTP {r.status}" + (" metrics" if r.read(6) == b"# HELP" else "")
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except Exception:  # noqa: BLE001 - not HTTP: gRPC below
        pass
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        for method in RAY_GRPC_METHODS:
            try:
                channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)(b"", timeout=5)
                return f"OK {method}"
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    return e.code().name
    return "UNIMPLEMENTED"


def test_the_default_cluster_is_closed_to_the_network(cluster):
    """pdserve's own servers (client APIs, KV servers) listen on loopback only. Ray 2.60 binds
    its servers beyond loopback whatever it is told (pdserve_app/ray_head.py), so `up` starts
    it with token authentication: every Ray server reachable from the network refuses a caller
    without the token, except the read-only Prometheus metrics."""
    from pdserve_app.ray_head import TOKEN_PATH

    assert "Ray token authentication is on (token in" in cluster["up"].stderr, cluster["up"].stderr[-2000:]
    assert TOKEN_PATH.stat().st_mode & 0o777 == 0o600
    procs = ray_processes()
    assert any("gcs_server" in c for c in procs.values()) and any(c.startswith("ray::ServeReplica:pdserve:decode") for c in procs.values())
    sockets = listening_sockets(procs)
    kv_ports = {int(pools_stats()["prefill"]["kv_address"].rsplit(":", 1)[1])}
    ours = {port: host for host, port, _ in sockets if port in {GRPC_PORT, HTTP_PORT, *kv_ports}}
    assert ours == {GRPC_PORT: "127.0.0.1", HTTP_PORT: "127.0.0.1", **{p: "127.0.0.1" for p in kv_ports}}, ours
    node_ip = in_ray("result = ray.util.get_node_ip_address()")
    answers = {(port, procs[pid].split(" ")[0][-40:]): without_token(node_ip, port) for host, port, pid in sockets if host not in ("127.0.0.1", "::1")}
    assert answers, "Ray listens on loopback only: make the test stricter"
    allowed = {"UNAUTHENTICATED", "HTTP 401", "HTTP 200 metrics"}
    assert {k: a for k, a in answers.items() if a not in allowed} == {}, answers
    assert "UNAUTHENTICATED" in answers.values()


def settled() -> dict[str, dict]:
    """Both pools' stats once nothing runs, is held or leased there (or at the hang deadline)."""
    code = """import time
deadline = time.monotonic() + 100
while True:
    result = {p: serve.get_deployment_handle(p, 'pdserve').stats.remote().result(timeout_s=30) for p in ('prefill', 'decode')}
    if all(s['num_running'] == 0 and s['num_free_blocks'] == s['num_blocks'] for s in result.values()) and result['prefill']['num_held'] == 0:
        break
    if time.monotonic() > deadline:
        break
    time.sleep(0.25)"""
    return in_ray(code)


def test_a_router_killed_mid_stream_leaves_no_work_in_the_pools(cluster):
    """8 streams of 400 tokens; the router replica is killed once each has tokens. Both pools
    stop its requests (their caller watch, pdserve/callers.py), with nothing left running,
    held or leased; a new router replica serves."""
    before = pools_stats()
    client = Client(f"127.0.0.1:{GRPC_PORT}", retries=0)
    got = [0] * 8
    started = threading.Barrier(9, timeout=HANG_S)

    def stream(i: int) -> str:
        try:
            for n, chunk in enumerate(client.stream(f"Count to a thousand, number {i}:", max_tokens=400, ignore_eos=True, timeout_s=HANG_S)):
                got[i] += len(chunk.token_ids)
                if n == 1:
                    started.wait()
            return "finished"
        except grpc.RpcError as e:
            return e.code().name

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, i) for i in range(8)]
        started.wait()
        in_ray("result = next(a['name'] for a in ray.util.list_named_actors(all_namespaces=True) "
               "if a['name'].startswith('SERVE_REPLICA::pdserve#router#'))\n"
               "ray.kill(ray.get_actor(result, namespace='serve'), no_restart=True)")
        outcomes = [f.result(timeout=HANG_S) for f in futures]
    assert outcomes == ["UNAVAILABLE"] * 8 and all(0 < n < 400 for n in got), (outcomes, got)
    after = settled()
    for pool in ("prefill", "decode"):
        assert after[pool]["num_running"] == 0 and after[pool]["num_free_blocks"] == after[pool]["num_blocks"], after[pool]
    assert after["prefill"]["num_held"] == 0
    stopped = after["decode"]["num_stopped_for_dead_caller"] - before["decode"]["num_stopped_for_dead_caller"]
    assert stopped == 8, after["decode"]  # stopped by the watch, not run on to max_tokens
    deadline = time.monotonic() + HANG_S
    while True:  # Ray Serve starts a new router replica
        try:
            assert client.generate("Hi", max_tokens=4, timeout_s=30).completion_tokens == 4
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "no new router replica"
            time.sleep(1)
    client.close()


def http_post(path: str, body: dict, timeout: float = HANG_S):
    request = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}{path}", json.dumps(body).encode(), {"content-type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def test_down_drains_then_stops(cluster):
    """`pdserve down --drain-s DRAIN_S` with 3 short (SHORT tokens) and 3 long streams (gRPC) and a long HTTP
    stream running: new requests are refused with a retry hint, the short streams finish
    whole, the long ones end with an error (a status, an error event), never a silent cut."""
    client = Client(f"127.0.0.1:{GRPC_PORT}", retries=0)
    got: dict[str, list] = {}
    started = threading.Barrier(8, timeout=HANG_S)

    def grpc_stream(name: str, max_tokens: int):
        chunks = got.setdefault(name, [])
        try:
            for chunk in client.stream(f"Tell me a long story, {name}.", max_tokens=max_tokens, ignore_eos=True, timeout_s=HANG_S):
                chunks.append(chunk)
                if len(chunks) == 1:
                    started.wait()
            return "ok"
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"

    def http_stream():
        lines = got.setdefault("http", [])
        with http_post("/v1/completions", {"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    lines.append(line[5:].strip())
                    if len(lines) == 1:
                        started.wait()
        return "ok"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = {f"short{i}": pool.submit(grpc_stream, f"short{i}", SHORT) for i in range(3)}
        futures.update({f"long{i}": pool.submit(grpc_stream, f"long{i}", 4000) for i in range(3)})
        futures["http"] = pool.submit(http_stream)
        started.wait()
        down = pool.submit(pdserve, "down", "--drain-s", str(DRAIN_S))
        deadline, refused = time.monotonic() + HANG_S, None
        while refused is None:  # a new request, until the drain has begun: then it is refused
            assert time.monotonic() < deadline, "the drain never began"
            try:
                client.generate("Hi", max_tokens=1, timeout_s=30)
                time.sleep(0.1)
            except grpc.RpcError as e:
                refused = e
        with pytest.raises(urllib.error.HTTPError) as refused_http:
            http_post("/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        outcomes = {name: f.result(timeout=HANG_S) for name, f in futures.items()}
        cluster["down"] = down.result(timeout=HANG_S)
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details(), refused
    assert ("retry-after", "1") in tuple(refused.trailing_metadata())
    assert refused_http.value.code == 503 and refused_http.value.headers["Retry-After"] == "1"
    for i in range(3):
        assert outcomes[f"short{i}"] == "ok" and sum(len(c.token_ids) for c in got[f"short{i}"]) == SHORT
        assert got[f"short{i}"][-1].finish_reason == "length"
        assert outcomes[f"long{i}"].startswith("UNAVAILABLE: the server shut down before this request finished"), outcomes[f"long{i}"]
        assert 0 < sum(len(c.token_ids) for c in got[f"long{i}"]) < 4000
    error_events = [json.loads(x) for x in got["http"] if x != "[DONE]" and "error" in json.loads(x)]
    assert outcomes["http"] == "ok" and len(error_events) == 1 and error_events[0]["error"]["code"] == 503, got["http"][-3:]
    assert got["http"][-1] == "[DONE]"
    down = cluster["down"]
    assert down.returncode == 0, down.stderr[-3000:]
    counts = re.search(rf"Drained 1 router replica\(s\): of (\d+) requests in flight, (\d+) finished within {DRAIN_S} s and 4 ended with an error", down.stderr)
    # the short streams still running when the drain began finished during it (on a slow host all three
    # may have ended before it began: each one's whole answer is checked above either way), and so may
    # one of the loop's one-token probes, in flight as the drain began
    assert counts and 0 <= int(counts[2]) <= 4 and int(counts[1]) == int(counts[2]) + 4, down.stderr
    assert "pdserve is down." in down.stdout
    client.close()
