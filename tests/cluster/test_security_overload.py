"""Security and overload on a real cluster: TLS on both client APIs (a plaintext client and
one trusting another CA are refused), client certificates on gRPC (mTLS: a client without
one, or with one from another CA, is refused), the API key over it on gRPC and HTTP, the KV channel's
shared secret, request size limits, and admission control with a retry hint. (The soak with faults:
tests/cluster/test_reliability.py.)"""

from __future__ import annotations

import http.client as http_client
import json
import ssl
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from conftest import make_tls, serve_cluster

pytestmark = pytest.mark.e2e
GRPC_PORT, HTTP_PORT = 9160, 8160
API_KEY, MAX_IN_FLIGHT = "test-api-key", 4
PROMPT = list(range(2000, 2040))


TLS: dict[str, str] = {}  # the module's certificates: cert, key and ca (the CA the server's cert is signed by)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cert, key, ca = make_tls(tmp_path_factory.mktemp("tls"))
    TLS.update(cert=cert, key=key, ca=ca)
    yield from serve_cluster({
        "router": {"grpc_port": GRPC_PORT, "http_port": HTTP_PORT, "max_in_flight": MAX_IN_FLIGHT, "retry_after_s": 0.5,
                   "max_request_bytes": 65536, "tls_cert_file": cert, "tls_key_file": key, "tls_client_ca_file": ca},
        "security": {"api_key": API_KEY, "kv_secret": "kv-test-secret"},
        "kv_transfer": {"backend": "grpc", "on_fault": "fail"},  # a refused KV secret would fail the request, not hide
    }, api_key=API_KEY, client_kwargs={"tls_ca_file": ca, "tls_cert_file": cert, "tls_key_file": key})


def pool_stats(name: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(name, "pdserve").stats.remote().result(timeout_s=30)


def client(api_key: str | None = API_KEY, retries: int = 0, ca: str | None = None, cert: tuple[str, str] | None = None):
    """An SDK client over TLS trusting ``ca`` (the module's CA), presenting ``cert`` ((cert
    file, key file); the module's by default, () for none)."""
    from pdserve.client import Client

    cert_file, key_file = (TLS["cert"], TLS["key"]) if cert is None else (cert or (None, None))
    return Client(f"127.0.0.1:{GRPC_PORT}", api_key=api_key, retries=retries, tls_ca_file=ca or TLS["ca"],
                  tls_cert_file=cert_file, tls_key_file=key_file)


def https() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=TLS["ca"])


def http(path: str, body: dict | bytes | None = None, key: str | None = API_KEY) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"https://127.0.0.1:{HTTP_PORT}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120, context=https()) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


# -- TLS --------------------------------------------------------------------------------


def test_tls_refuses_plaintext_and_a_client_that_trusts_another_ca(cluster, tmp_path):
    from pdserve.client import Client

    _, _, other_ca = make_tls(tmp_path)
    for plain_or_wrong in (Client(f"127.0.0.1:{GRPC_PORT}", api_key=API_KEY, retries=0), client(ca=other_ca)):
        with plain_or_wrong as c, pytest.raises(grpc.RpcError) as info:
            c.generate(prompt_token_ids=PROMPT, max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    with pytest.raises((urllib.error.URLError, ConnectionError, http_client.HTTPException)):  # plain HTTP to the HTTPS port
        urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/health", timeout=10)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"https://127.0.0.1:{HTTP_PORT}/health", timeout=10, context=ssl.create_default_context(cafile=other_ca))
    with client() as c:  # the right CA: served, the API key checked over TLS (below, too)
        assert len(c.generate(prompt_token_ids=PROMPT, max_tokens=2).token_ids) == 2


def test_grpc_with_a_client_ca_refuses_clients_without_a_certificate_from_it(cluster, tmp_path):
    other_cert, other_key, _ = make_tls(tmp_path)  # a client certificate signed by another CA
    for cert in ((), (other_cert, other_key)):
        with client(cert=cert) as c, pytest.raises(grpc.RpcError) as info:
            c.generate(prompt_token_ids=PROMPT, max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    with client() as c:  # a certificate from router.tls_client_ca_file
        c.health(timeout_s=10)
        assert len(c.generate(prompt_token_ids=PROMPT, max_tokens=2).token_ids) == 2


# -- authentication -------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, "wrong"])
def test_grpc_without_the_api_key_is_refused(cluster, key):
    with client(key) as c, pytest.raises(grpc.RpcError) as info:
        c.generate(prompt_token_ids=PROMPT, max_tokens=4)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in info.value.details()


def test_with_the_key_the_answer_comes_through_the_secret_kv_channel(cluster, real_model_dir):
    import torch

    from conftest import reference_generate
    from pdserve.config import ClusterConfig
    from pdserve.model_loader import load_model, resolve_dtype

    before = pool_stats("decode")
    with client() as c:
        got = c.generate(prompt_token_ids=PROMPT, max_tokens=6, ignore_eos=True).token_ids
    torch.set_num_threads(1)
    want = reference_generate(load_model(real_model_dir, resolve_dtype(ClusterConfig())), PROMPT, 6, ignore_eos=True)
    assert got == want
    after = pool_stats("decode")
    assert after["num_kv_fetched"] == before["num_kv_fetched"] + 1 and after["num_kv_faults"] == before["num_kv_faults"]


def test_http_needs_the_bearer_token_except_health(cluster):
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2}
    for key in (None, "wrong"):
        status, _, answer = http("/v1/completions", body, key)
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        assert http("/v1/models", key=key)[0] == 401
    assert http("/v1/completions", body)[0] == 200 and http("/v1/models")[0] == 200
    with urllib.request.urlopen(f"https://127.0.0.1:{HTTP_PORT}/health", timeout=10, context=https()) as r:
        assert r.status == 200  # load balancers probe without a key


def test_requests_over_the_size_limit_are_refused(cluster):
    status, _, answer = http("/v1/completions", b'{"prompt": "' + b"x" * 70000 + b'"}')
    assert status == 413 and "max_request_bytes" in answer["error"]["message"]
    with client() as c, pytest.raises(grpc.RpcError) as info:
        c.generate("y" * 70000, max_tokens=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_request_bytes" in info.value.details()


# -- overload -------------------------------------------------------------------------


def test_beyond_max_in_flight_requests_get_resource_exhausted_with_a_retry_hint(cluster):
    from pdserve.client import server_retry_after_s

    outcomes: list[str] = []
    hints: list[float | None] = []

    def one(i: int):
        with client() as c:
            try:
                # long enough that the admitted ones still run when the HTTP request below comes
                # (48 tokens finished inside its 1 s wait on a fast decode step)
                c.generate(prompt_token_ids=[i + 3, *PROMPT], max_tokens=256, ignore_eos=True, timeout_s=120)
                outcomes.append("ok")
            except grpc.RpcError as e:
                outcomes.append(e.code().name)
                hints.append(server_retry_after_s(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3 * MAX_IN_FLIGHT)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    status, headers, answer = http("/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
    for t in threads:
        t.join(180)
    assert set(outcomes) == {"ok", "RESOURCE_EXHAUSTED"} and outcomes.count("ok") >= MAX_IN_FLIGHT, outcomes
    assert hints and all(h == 0.5 for h in hints)
    assert status == 429 and headers["retry-after"] == "1" and answer["error"]["type"] == "rate_limit_error"
    router = pool_stats("router")
    assert router["num_in_flight"] == 0 and router["num_refused"] >= outcomes.count("RESOURCE_EXHAUSTED")
