"""The `pdserve` command as a user runs it: up -> generate -> down, on a real local Ray cluster."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import HAS_GPU

pytestmark = pytest.mark.e2e

GRPC_PORT, HTTP_PORT = 9120, 8120


def pdserve(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    exe = shutil.which("pdserve", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}  # pdserve up's own default, not the tests'
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, env=env)


def niceness_by_process(prefixes: tuple[str, ...]) -> dict[str, set[int]]:
    """The nice values of every thread of the processes whose title starts with each prefix."""
    from pathlib import Path

    found: dict[str, set[int]] = {}
    for proc in Path("/proc").iterdir():
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, ValueError):
            continue
        for prefix in prefixes:
            if title.startswith(prefix):
                for task in (proc / "task").iterdir():
                    try:
                        stat = (task / "stat").read_text()
                    except OSError:
                        continue
                    found.setdefault(prefix, set()).add(int(stat[stat.rindex(")") + 2:].split()[16]))  # field 19: nice
    return found


def test_up_generate_down(tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "model:\n  dtype: float32\n"
        f"router:\n  grpc_port: {GRPC_PORT}\n  http_port: {HTTP_PORT}\n"
    )
    up = pdserve("up", str(config))
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert f"gRPC endpoint: 127.0.0.1:{GRPC_PORT}" in up.stdout
        assert "the pools load it in float32\n" in up.stderr  # the dtype is said (settled here when auto)
        # the Ray that `pdserve up` starts runs its workers at nice 0, not Ray's 15 (pdserve_app/cli.py)
        serving = ("ray::ServeReplica:pdserve:prefill", "ray::ServeReplica:pdserve:decode", "ray::ServeReplica:pdserve:router",
                   "ray::ProxyActor", "ray::ServeController")
        assert niceness_by_process(serving) == {p: {0} for p in serving}

        # the client APIs listen on loopback only (router.host's default)
        assert listening_hosts([GRPC_PORT, HTTP_PORT]) == {GRPC_PORT: {"127.0.0.1"}, HTTP_PORT: {"127.0.0.1"}}

        gen = pdserve("generate", "What is the capital of France?", "--max-tokens", "32")
        assert gen.returncode == 0, gen.stderr[-3000:]
        assert "Paris" in gen.stdout
        assert "TTFT" in gen.stderr and "TPOT" in gen.stderr and "prompt 37 tokens" in gen.stderr

        bad = pdserve("generate", "Hi", "--max-tokens", "0")
        assert bad.returncode == 1 and "INVALID_ARGUMENT: max_tokens must be >= 1" in bad.stderr

        # Serve applies its HTTP port only when it starts: a redeploy that moves it is refused, and the cluster keeps serving
        moved = tmp_path / "moved.yaml"
        moved.write_text(config.read_text().replace(f"http_port: {HTTP_PORT}", f"http_port: {HTTP_PORT + 1}"))
        redeploy = pdserve("up", str(moved), "--redeploy")
        assert redeploy.returncode == 1 and f"Ray Serve already serves HTTP on 127.0.0.1:{HTTP_PORT}" in redeploy.stderr, redeploy.stderr[-3000:]
        # pools the head `up` started (os.cpu_count() CPUs) cannot hold: refused before Serve is asked, not left pending
        big, cpus = tmp_path / "big.yaml", os.cpu_count()
        big.write_text(config.read_text() + f"decode:\n  ray_actor_options: {{num_cpus: {cpus}}}\n")
        redeploy = pdserve("up", str(big), "--redeploy")
        assert redeploy.returncode == 2, redeploy.stderr[-3000:]
        assert f"need {cpus + 1} CPU together, and this Ray cluster has {cpus}:" in redeploy.stderr, redeploy.stderr[-3000:]
        assert pdserve("generate", "Hi", "--max-tokens", "2").returncode == 0
    finally:
        down = pdserve("down")
    assert down.returncode == 0, down.stderr[-3000:]
    gone = pdserve("generate", "Hi", "--endpoint", f"127.0.0.1:{GRPC_PORT}")
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr


def listening_hosts(ports: list[int]) -> dict[int, set[str]]:
    """The addresses TCP ``ports`` listen on, from /proc/net/tcp and tcp6 ("0.0.0.0" / "::" = every interface)."""
    import ipaddress

    found: dict[int, set[str]] = {p: set() for p in ports}
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port = local.split(":")
            if state == "0A" and int(port, 16) in found:  # LISTEN
                raw = bytes.fromhex(address)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))  # each 32-bit word is in host (little-endian) order
                ip = ipaddress.ip_address(raw)
                found[int(port, 16)].add(str(getattr(ip, "ipv4_mapped", None) or ip))  # ::ffff:127.0.0.1 is 127.0.0.1
    return found


def ray_is_running() -> bool:
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    return subprocess.run([ray, "status"], capture_output=True, timeout=120).returncode == 0


def test_up_refuses_what_a_replica_would_refuse_in_one_line_and_starts_nothing(tmp_path):
    """A decode KV pool smaller than the context: refused by `up` before Ray starts; then a
    `down` with nothing running ends at once and says so."""
    config = tmp_path / "cluster.yaml"
    config.write_text(f"router:\n  grpc_port: {GRPC_PORT}\n  http_port: {HTTP_PORT}\ndecode:\n  kv_cache_tokens: 1024\n")
    up = pdserve("up", str(config))
    assert up.returncode == 2, up.stderr[-3000:]
    assert up.stderr.strip().splitlines()[-1] == (
        "error: decode: the KV pool holds 1024 tokens, less than the context of 8192; "
        "raise kv_cache_tokens/kv_cache_bytes or lower model.max_model_len")
    assert not ray_is_running()
    down = pdserve("down", timeout=200)
    assert down.returncode == 0 and "No running Ray cluster found." in down.stderr and "pdserve is down." in down.stdout


def test_up_refuses_an_architecture_the_engine_does_not_implement_before_ray_starts(tmp_path):
    """A checkpoint whose config.json names DeepseekV3ForCausalLM: `up` reads it and exits 2 in
    one line naming the supported list; no replica loads the weights to find out."""
    from transformers import DeepseekV3Config

    model_dir = tmp_path / "deepseek_v3"
    DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256).save_pretrained(model_dir)
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model:\n  path: {model_dir}\n  dtype: float32\nrouter:\n  grpc_port: {GRPC_PORT}\n  http_port: {HTTP_PORT}\n")
    up = pdserve("up", str(config), timeout=120)
    assert up.returncode == 2, up.stderr[-3000:]
    assert up.stderr.strip().splitlines()[-1] == (
        "error: model architecture 'DeepseekV3ForCausalLM' is not implemented by pdserve's engine; "
        "supported: DeepseekV2ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
        "Qwen3MoeForCausalLM")
    assert not ray_is_running()


def test_a_failed_up_stops_the_ray_head_it_started(tmp_path):
    """Replicas that cannot start (model.device: cuda on a machine without one): `up` fails
    with the replica's reason and stops the Ray head it started; `down` after it is clean."""
    import torch

    if torch.cuda.is_available():
        pytest.skip(HAS_GPU)  # the replicas would start
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model:\n  device: cuda\n  dtype: float32\nrouter:\n  grpc_port: {GRPC_PORT}\n  http_port: {HTTP_PORT}\n")
    up = pdserve("up", str(config))
    assert up.returncode == 1, up.stderr[-3000:]
    last = up.stderr.strip().splitlines()[-1]
    assert last.startswith("error: deploy failed:") and "no CUDA device" in last and last.endswith("is stopped)"), last
    assert not ray_is_running()
    down = pdserve("down", timeout=200)
    assert down.returncode == 0 and "pdserve is down." in down.stdout
