"""Loading once: the engine over weights read from safetensors straight into its layout
(engine/checkpoint.py) computes the bits it computes over the loaded transformers model, in
every family, and a load's peak memory stays within 1.3x of the weights it keeps."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from conftest import tiny_model
from pdserve.engine.checkpoint import CheckpointError
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.kv_fingerprint import weights_hash
from pdserve.model_loader import load_checkpoint, load_model
from pdserve.sampling import SamplingParams
from test_engine import random_prompts, run_to_completion

EOS = frozenset({2})
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "mistral_window", "phi3", "mixtral", "qwen3_moe", "gemma2", "gemma3"]
ROOT = Path(__file__).parents[2]


def outputs(model, backend: str = "auto") -> list:
    """Greedy ids with top-5 logprobs of a small batch, chunked."""
    engine = Engine(model, EngineConfig(num_blocks=128, block_size=4, chunk_size=16, backend=backend), EOS, 512)
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5))
            for i, p in enumerate(random_prompts([5, 33, 40], seed=2))]
    for seq in seqs:
        engine.add(seq)
    run_to_completion(engine)
    return [[(lp.token_id, lp.logprob, list(lp.top)) for lp in seq.logprobs] for seq in seqs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_over_safetensors_computes_the_bits_it_computes_over_the_transformers_model(family, dtype, tmp_path):
    """bf16: a checkpoint saved in float32 and read as bf16 (converted as read)."""
    tiny_model(family, seed=3).save_pretrained(tmp_path)
    assert outputs(load_checkpoint(tmp_path, dtype)) == outputs(load_model(tmp_path, dtype))


def test_the_torch_backend_too(tmp_path):
    tiny_model("qwen3_moe", seed=3).save_pretrained(tmp_path)
    assert outputs(load_checkpoint(tmp_path, "bfloat16"), "torch") == outputs(load_model(tmp_path, "bfloat16"), "torch")


def test_shards_tied_embeddings_and_bf16_files(tmp_path):
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    checkpoint = load_checkpoint(tmp_path, "bfloat16")
    assert checkpoint.get("lm_head.weight") is None  # tied: the model's LM head is the embedding
    assert outputs(checkpoint) == outputs(load_model(tmp_path, "bfloat16"))


def test_packed_layers_keep_no_dense_copy_and_the_packed_weights_lie_in_one_run(tmp_path):
    tiny_model("llama", seed=3).save_pretrained(tmp_path)
    engine = Engine(load_checkpoint(tmp_path, "float32"), EngineConfig(num_blocks=16, backend="cpu"), EOS, 512)
    linears = [lin for layer in engine.model.layers for lin in layer.linears()] + [engine.model.lm_head]
    assert all(lin.weight is None for lin in linears)
    starts = [lin.packed.data_ptr() for lin in linears]
    assert starts == sorted(starts)  # step order, one after another (the arena, or huge_pages.gather's run)


def test_the_fingerprint_hashes_the_weights_as_read(tmp_path):
    tiny_model("llama", seed=3).save_pretrained(tmp_path / "a")
    tiny_model("llama", seed=4).save_pretrained(tmp_path / "b")

    def read(path, dtype="float32"):
        checkpoint = load_checkpoint(path, dtype)
        Engine(checkpoint, EngineConfig(num_blocks=16), EOS, 512)
        return weights_hash(checkpoint)

    assert read(tmp_path / "a") == read(tmp_path / "a")
    assert read(tmp_path / "a") != read(tmp_path / "b")
    assert read(tmp_path / "a") != read(tmp_path / "a", "bfloat16")


def _rewrite(path: Path, drop: str | None = None, cut: int = 0) -> None:
    """Rewrite a one-file safetensors checkpoint without tensor ``drop``, or ``cut`` bytes short."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    if drop:
        del header[drop]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size : len(raw) - cut])


@pytest.mark.parametrize("drop, cut, message", [
    ("model.layers.1.mlp.down_proj.weight", 0, "has none of model.layers.1.mlp.down_proj.weight"),
    ("model.norm.weight", 0, "no tensor 'model.norm.weight'"),
    (None, 1000, "ends inside"),
])
def test_a_checkpoint_short_of_a_tensor_is_refused_by_name(tmp_path, drop, cut, message):
    tiny_model("llama", seed=3).save_pretrained(tmp_path)
    _rewrite(tmp_path / "model.safetensors", drop, cut)
    with pytest.raises(CheckpointError, match=message):
        Engine(load_checkpoint(tmp_path, "float32"), EngineConfig(num_blocks=16), EOS, 512)


def _load_memory(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.load_memory", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_load_peaks_within_1_3x_the_weights_it_keeps(tmp_path, real_model_dir):
    """Counted in bytes (VmHWM's growth over the process before the load), on a 0.6B-parameter
    random Llama written by the test (bf16 file, read as bf16: over a GB, far above the
    process's own noise) and on the bundled model (float32 file, read as bf16: converted as read)."""
    _load_memory("--write-random", str(tmp_path / "big"), "--params", "6e8")
    big = _load_memory("--model", str(tmp_path / "big"), "--dtype", "bfloat16")
    assert big["weights_kept_bytes"] > 1e9
    assert big["peak_growth_bytes"] <= 1.3 * big["weights_kept_bytes"], big
    bundled = _load_memory("--model", str(real_model_dir), "--dtype", "bfloat16")
    assert bundled["peak_growth_bytes"] <= 1.3 * bundled["weights_kept_bytes"], bundled


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def test_a_config_without_architectures_is_served_by_its_model_type(tmp_path):
    tiny_model("qwen3", seed=3).save_pretrained(tmp_path)
    _edit_config(tmp_path, architectures=None)
    checkpoint = load_checkpoint(tmp_path, "float32")
    assert checkpoint.architecture == "Qwen3ForCausalLM"
    assert outputs(checkpoint) == outputs(load_model(tmp_path, "float32"))


def test_a_stored_head_is_used_where_the_config_ties_it_as_transformers_does(tmp_path):
    """A fine-tune whose config keeps tie_word_embeddings but which saved a head of its own:
    transformers unties them and uses the stored head; so does the reader."""
    tiny_model("llama", seed=3).save_pretrained(tmp_path)  # untied: both tables stored, different values
    _edit_config(tmp_path, tie_word_embeddings=True)
    assert outputs(load_checkpoint(tmp_path, "float32")) == outputs(load_model(tmp_path, "float32"))


def test_shards_are_the_files_the_index_names(tmp_path):
    """Another safetensors file beside the shards (Mistral's repositories ship
    ``consolidated.safetensors``, with other names) is not read."""
    tiny_model("llama", seed=3).save_pretrained(tmp_path, max_shard_size="40KB")
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.zeros(64)}, str(tmp_path / "consolidated.safetensors"))
    assert outputs(load_checkpoint(tmp_path, "float32")) == outputs(load_model(tmp_path, "float32"))


def test_windowed_attention_in_torch_rows_runs_no_cuda_graphs():
    """The default forward_windowed loops over the step's lists in Python: a captured graph
    would replay the lists it was captured with, so an engine whose backend runs windowed
    layers that way decodes eagerly. The cpu backend's kernels take windows and soft-caps."""
    engine = Engine(tiny_model("gemma2", seed=3), EngineConfig(num_blocks=64, cuda_graphs=True, backend="torch"), EOS, 512)
    assert engine.model.torch_rows and engine.runner.graphs is None
    assert Engine(tiny_model("llama", seed=3), EngineConfig(num_blocks=64, cuda_graphs=True, backend="torch"), EOS, 512).runner.graphs is not None
    on_cpu = Engine(tiny_model("gemma2", seed=3), EngineConfig(num_blocks=64, backend="auto"), EOS, 512)
    assert on_cpu.backend.name != "cpu" or on_cpu.model.torch_rows == []


def test_the_arena_reuses_a_packed_weight_given_back_and_keeps_earlier_ones():
    from pdserve.engine.huge_pages import MIN_BYTES, Arena

    arena = Arena(2 * MIN_BYTES)
    kept = arena.take(1000, torch.float32)
    if kept is None:
        pytest.skip("no anonymous mapping here (off Linux)")
    trial = arena.take(1000, torch.float32)
    arena.give_back(trial)  # the last one taken: its bytes go to the next
    assert arena.take(10, torch.float32).data_ptr() == trial.data_ptr()
    arena.give_back(kept)  # not the last: stays
    assert arena.take(10, torch.float32).data_ptr() > kept.data_ptr()
    assert arena.take(2 * MIN_BYTES, torch.uint8) is None  # past its capacity: the caller allocates
