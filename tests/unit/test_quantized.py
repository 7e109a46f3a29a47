"""Linear layers over the GGUF's blocks as stored (cpu/linear_q.h, cluster.yaml ``weights``).

The kernels widen the blocks into exactly the weights gguf-py and transformers de-quantize
to, so a quantized layer is the dense layer's bits: checked per block type against gguf's
own de-quantization on the bundled file's tensors, per kernel against the dense kernel in
float32 and bf16, and end to end on the bundled model (HF ``generate`` in float32, a
needle's logprobs alone, in a batch and chunked, dense or quantized).
"""

import logging

import gguf
import numpy as np
import pytest
import torch

from conftest import reference_generate, require_kernels
from pdserve.config import ClusterConfig, ConfigError
from pdserve.engine.cpu import ops
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.quantized import QuantizedWeight
from pdserve.engine.sequence import Sequence
from pdserve.model_loader import bundled_gguf_path, load_model, load_tokenizer
from pdserve.sampling import SamplingParams
from pdserve.worker import eos_token_ids, quantized_weights
from test_engine import assert_all_blocks_free, generate_all, run_to_completion


def _kernels_or_skip():
    require_kernels("linear")


@pytest.fixture(scope="module")
def gguf_tensors():
    reader = gguf.GGUFReader(str(bundled_gguf_path()))
    return {t.name: t for t in reader.tensors}


def _q4_0_tensor(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q4_0 blocks [n, k / 32 * 18] (the bundled file has none): d float16, 16 bytes of nibbles."""
    rng = np.random.default_rng(seed)
    blocks = np.zeros((n, k // 32, 18), dtype=np.uint8)
    blocks[:, :, :2] = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
    blocks[:, :, 2:] = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    return blocks.reshape(n, -1)


def _k_quant_tensor(kind: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K or Q6_K super-blocks [n, k / 256 * bytes]: random quants and 6-bit / int8
    scales, float16 d (and dmin) of 1e-4 to 1e-1, as a quantizer would store them."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)][1]
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for at in ((0, 2) if kind == 12 else (208,)):  # Q4_K: d, dmin first; Q6_K: d last
        blocks[:, :, at:at + 2] = rng.uniform(1e-4, 1e-1, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def _cases(tensors):
    for name in ("blk.0.attn_q.weight", "blk.5.ffn_down.weight", "blk.2.attn_v.weight", "token_embd.weight"):
        t = tensors[name]
        yield name, int(t.tensor_type), np.ascontiguousarray(t.data), int(t.shape[1]), int(t.shape[0])
    yield "random Q4_0", int(gguf.GGMLQuantizationType.Q4_0), _q4_0_tensor(100, 96), 100, 96
    yield "random Q4_K", int(gguf.GGMLQuantizationType.Q4_K), _k_quant_tensor(12, 100, 512, 1), 100, 512
    yield "random Q6_K", int(gguf.GGMLQuantizationType.Q6_K), _k_quant_tensor(14, 37, 768, 2), 37, 768


def test_blocks_widen_to_ggufs_own_values_and_the_kernel_is_the_dense_kernels_bits(gguf_tensors):
    """Per block type (Q4_1 and Q8_0 from the bundled file; Q4_0, Q4_K and Q6_K random; N not
    always a multiple of the panel): de-quantized values bit for bit as ``gguf.quants.dequantize``,
    and ``qlinear`` bit for bit as ``linear`` over those values, float32 and bf16, any rows
    (1 to 64), 1 or 2 threads, with a bias."""
    _kernels_or_skip()
    torch.manual_seed(0)
    for name, kind, data, n, k in _cases(gguf_tensors):
        want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(kind)).reshape(n, k).astype(np.float32)
        packed = ops.qpack(kind, torch.from_numpy(data), n, k)
        assert torch.equal(ops.qdequant(packed, n, k).view(torch.int32), torch.from_numpy(want).view(torch.int32)), name
        # bf16 on AMX tiles is the one case quantized_ok refuses (the engine keeps dense weights there)
        for dtype in [d for d in (torch.float32, torch.bfloat16) if ops.quantized_ok(d)]:
            dense = ops.pack(torch.from_numpy(want).to(dtype))
            bias = torch.randn(n).to(dtype)
            for m in (1, 5, 6, 7, 64):
                x = torch.randn(m, k).to(dtype)
                got = ops.qlinear(x, packed, n, bias, num_threads=2)
                assert torch.equal(got, ops.linear(x, dense, n, bias)), (name, dtype, m)
                assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                   ops.linear(x, dense, n, bias).view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_embedding_rows_widen_to_ggufs_own_values(gguf_tensors):
    """The embedding's row de-quantization (layers/embedding.py, torch ops) per block type,
    bit for bit as ``gguf.quants.dequantize``, on any subset of rows."""
    from pdserve.engine.layers.embedding import dequantize_rows

    for name, kind, data, n, k in _cases(gguf_tensors):
        want = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(kind)).reshape(n, k).astype(np.float32))
        rows = torch.tensor([n - 1, 0, 3, 3, n // 2])
        got = dequantize_rows(kind, torch.from_numpy(data)[rows])
        assert torch.equal(got.view(torch.int32), want[rows].view(torch.int32)), name
    with pytest.raises(ValueError, match="GGUF type 13"):
        dequantize_rows(13, torch.zeros(2, 176, dtype=torch.uint8))  # Q5_K


def test_unsupported_shapes_and_types_are_refused_by_name():
    _kernels_or_skip()
    with pytest.raises(ValueError, match="Q4_0"):
        ops.qpack(13, torch.zeros(4, 176, dtype=torch.uint8), 4, 256)  # Q5_K
    with pytest.raises(ValueError, match="in_features % 32"):
        ops.qpack(8, torch.zeros(4, 34, dtype=torch.uint8), 4, 33)
    with pytest.raises(ValueError, match="256 for Q4_K"):
        ops.qpack(12, torch.zeros(4, 72, dtype=torch.uint8), 4, 128)


@pytest.fixture(scope="module")
def quantized_f32(real_model_dir):
    torch.set_num_threads(1)
    model = load_model(real_model_dir, "float32")
    cfg = ClusterConfig.from_dict({"model": {"path": "smollm2"}})
    return model, quantized_weights(cfg, "decode", model.config, "float32")


def engine_for(model, quantized, **config):
    tokenizer = load_tokenizer(model.name_or_path)
    return Engine(model, EngineConfig(**config), eos_token_ids(model, tokenizer), 4096, quantized=quantized)


def test_every_linear_layer_of_the_bundled_model_runs_on_its_blocks(quantized_f32):
    """All 30 layers' QKV, O, gate-up and down, and the tied LM head (Q8_0): the Q and K
    rows un-permuted as transformers does, each layer's blocks checked against its weight."""
    _kernels_or_skip()
    model, quantized = quantized_f32
    assert len(quantized) == 30 * 7 + 2 and quantized["lm_head.weight"] is quantized["model.embed_tokens.weight"]
    engine = engine_for(model, quantized, num_blocks=64)
    assert engine.model.quantized == {"layers": True, "lm_head": True, "embedding": True}
    assert all(layer.qkv.quantized and layer.down.quantized for layer in engine.model.layers)
    # what reads blocks keeps no dense copy: no float32 tensor of the model's size is left
    assert engine.model.embed.weight is None and engine.model.lm_head.weight is None
    assert all(lin.weight is None for layer in engine.model.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))


def test_quantized_float32_equals_generate_batched_chunked_and_preempted(quantized_f32, real_model_dir):
    """The float32 equality rule on the quantized engine: 6 mixed prompts decoded together on
    a pool small enough to preempt, prefilled in chunks of 48, against HF ``generate``."""
    _kernels_or_skip()
    model, quantized = quantized_f32
    ids = load_tokenizer(real_model_dir)("Rivers shape the land they cross and carry silt to the sea. " * 40).input_ids
    prompts = [ids[i * 30 : i * 30 + n] for i, n in enumerate([90, 61, 120, 75, 100, 17])]
    engine = engine_for(model, quantized, num_blocks=28, chunk_size=48, max_num_batched_tokens=96)
    seqs = generate_all(engine, prompts, 24)
    assert engine.scheduler.num_preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(model, prompt, 24, ignore_eos=True)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_needle_is_the_same_bits_dense_or_quantized_alone_batched_or_chunked(real_model_dir, dtype):
    """Batch invariance with quantized weights, and quantized == dense: a needle's 12
    logprobs (with the top 5) alone on a dense engine, and alone, in a batch of 12 and
    chunked on quantized ones, compared with ``==``."""
    _kernels_or_skip()
    model = load_model(real_model_dir, dtype)
    quantized = quantized_weights(ClusterConfig.from_dict({"model": {"path": "smollm2"}, "decode": {"weights": "quantized"}}), "decode",
                                  model.config, dtype)
    ids = load_tokenizer(real_model_dir)("A river cuts valleys, carries silt to the sea and builds deltas. " * 30).input_ids
    needle = ids[100:230]
    others = [ids[i * 7 : i * 7 + 5 + 9 * i] for i in range(11)]

    def needle_out(engine, neighbours):
        seqs = [Sequence(f"r{i}", list(x), len(x), SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5))
                for i, x in enumerate(neighbours[:4] + [needle] + neighbours[4:])]
        for seq in seqs:
            engine.add(seq)
        run_to_completion(engine)
        assert_all_blocks_free(engine)
        return [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in seqs[min(4, len(neighbours))].logprobs]

    want = needle_out(engine_for(model, None, num_blocks=256), [])
    assert needle_out(engine_for(model, quantized, num_blocks=256), []) == want
    assert needle_out(engine_for(model, quantized, num_blocks=256), others) == want
    assert needle_out(engine_for(model, quantized, num_blocks=256, chunk_size=40, max_num_batched_tokens=64), others[:3]) == want


def test_blocks_that_do_not_match_the_weights_fall_back_to_dense_with_a_warning(quantized_f32, caplog):
    """A layer whose blocks de-quantize to other values (here: another layer's) keeps its
    dense weight; as one fused call runs all layers, they all go dense, and the log says so."""
    _kernels_or_skip()
    model, quantized = quantized_f32
    wrong = dict(quantized)
    wrong["model.layers.3.mlp.down_proj.weight"] = quantized["model.layers.4.mlp.down_proj.weight"]
    with caplog.at_level(logging.WARNING):
        engine = engine_for(model, wrong, num_blocks=64)
    assert "model.layers.3.mlp.down_proj.weight" in caplog.text and "all dense" in caplog.text
    assert engine.model.quantized == {"layers": False, "lm_head": True, "embedding": True}


def test_weights_key_chooses_per_pool(real_model_dir):
    """auto: quantized in float32 decode and colocated pools, dense in prefill pools and in
    bf16; ``quantized`` and ``dense`` as said; an HF directory stays dense; a bad value is
    refused by name."""
    model = load_model(real_model_dir, "float32")
    auto = ClusterConfig.from_dict({"model": {"path": "smollm2"}})
    assert quantized_weights(auto, "prefill", model.config, "float32") is None
    assert isinstance(quantized_weights(auto, "decode", model.config, "float32")["model.layers.0.self_attn.q_proj.weight"], QuantizedWeight)
    assert quantized_weights(auto, "colocated", model.config, "float32") is not None
    assert quantized_weights(auto, "decode", model.config, "bfloat16") is None
    forced = ClusterConfig.from_dict({"model": {"path": "smollm2"}, "prefill": {"weights": "quantized"}, "decode": {"weights": "dense"}})
    assert quantized_weights(forced, "prefill", model.config, "bfloat16") is not None
    assert quantized_weights(forced, "decode", model.config, "float32") is None
    hf_dir = ClusterConfig.from_dict({"model": {"path": str(real_model_dir)}})
    assert quantized_weights(hf_dir, "decode", model.config, "float32") is None
    with pytest.raises(ConfigError, match="decode.weights must be one of auto, dense, quantized"):
        ClusterConfig.from_dict({"decode": {"weights": "int4"}})


def test_a_dense_prefill_pool_and_a_quantized_decode_pool_share_a_kv_fingerprint():
    """The fingerprint hashes the de-quantized model both pools load, so their KV is
    exchanged (a different model's is refused by its weights hash: test_kv_transfer.py)."""
    from pdserve.worker import build_engine

    _kernels_or_skip()
    pool = {"num_threads": 1, "kv_cache_tokens": 1024}
    cfg = ClusterConfig.from_dict({"model": {"path": "smollm2", "max_model_len": 1024, "dtype": "float32"}, "prefill": pool,
                                   "decode": pool, "kv_transfer": {"backend": "grpc"}})
    prefill, fp_prefill = build_engine(cfg, "prefill")
    decode, fp_decode = build_engine(cfg, "decode")
    assert prefill.model.quantized == {"layers": False, "lm_head": False, "embedding": False}
    assert decode.model.quantized == {"layers": True, "lm_head": True, "embedding": True}
    assert fp_prefill == fp_decode


def test_embedding_reads_its_blocks_only_where_they_are_the_tables_bits(gguf_tensors, caplog):
    """The bundled Q8_0 table: rows looked up in the blocks equal the dense table's, in
    float32 and bf16, and no dense copy is kept; a table that differs in one weight keeps the
    dense table, with a warning."""
    import torch.nn.functional as F

    from pdserve.engine.layers import Embedding

    t = gguf_tensors["token_embd.weight"]
    n, k = int(t.shape[1]), int(t.shape[0])
    blocks = QuantizedWeight(int(t.tensor_type), torch.from_numpy(np.array(t.data, copy=True)), n, k)
    table = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(n, k).astype(np.float32))
    ids = torch.tensor([0, 1, 17, n - 1, 17, 4242])
    for dtype in (torch.float32, torch.bfloat16):
        emb = Embedding(table.to(dtype), blocks)
        assert emb.quantized and emb.weight is None
        assert torch.equal(emb(ids), F.embedding(ids, table.to(dtype))), dtype
    off = table.clone()
    off[4242, 7] += 1e-3
    with caplog.at_level(logging.WARNING):
        emb = Embedding(off, blocks)
    assert not emb.quantized and "embedding" in caplog.text
    assert torch.equal(emb(ids), F.embedding(ids, off))


def _quantize_k(kind: int, x: np.ndarray) -> np.ndarray:
    """A plain Q4_K or Q6_K quantizer for tests (gguf-py has none): x [N, K] float32 -> the
    blocks [N, K / 256 * bytes] in ggml's layout, as ``gguf.quants`` reads them back."""
    n, k = x.shape
    s = k // 256
    if kind == 12:  # per 32 weights w = (d * sc) * q - dmin * m, q 0..15, sc and m 6-bit
        sb = x.reshape(n, s, 8, 32)
        lo, hi = np.minimum(sb.min(-1), 0), sb.max(-1)
        d = ((hi - lo) / 15).max(-1, keepdims=True) / 63
        dmin = (-lo).max(-1, keepdims=True) / 63
        d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
        sc = np.clip(np.round((hi - lo) / 15 / np.maximum(d16.astype(np.float32), 1e-12)), 1, 63).astype(np.uint8)
        m = np.clip(np.round(-lo / np.maximum(dmin16.astype(np.float32), 1e-12)), 0, 63).astype(np.uint8)
        step, off = d16.astype(np.float32) * sc, dmin16.astype(np.float32) * m
        q = np.clip(np.round((sb + off[..., None]) / step[..., None]), 0, 15).astype(np.uint8)
        s12 = np.concatenate([sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6,
                              (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4], axis=-1)
        qs = (q[:, :, 0::2] | q[:, :, 1::2] << 4).reshape(n, s, 128)
        blocks = np.concatenate([d16.view(np.uint8), dmin16.view(np.uint8), s12, qs], axis=-1)
    else:  # Q6_K: per 16 weights w = (d * sc) * (q - 32), q 0..63, sc int8
        sb = x.reshape(n, s, 16, 16)
        scale = np.abs(sb).max(-1) / 31
        d16 = (scale.max(-1, keepdims=True) / 127).astype(np.float16)
        sc = np.clip(np.round(scale / np.maximum(d16.astype(np.float32), 1e-12)), 1, 127).astype(np.int8)
        step = d16.astype(np.float32) * sc
        q = (np.clip(np.round(sb / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, s, 2, 128)
        lo, hi = q & 15, q >> 4
        ql = (lo[..., :64] | lo[..., 64:] << 4).reshape(n, s, 128)
        qh = (hi[..., :32] | hi[..., 32:64] << 2 | hi[..., 64:96] << 4 | hi[..., 96:] << 6).reshape(n, s, 64)
        blocks = np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(n, -1))


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory):
    """The bundled GGUF with every layer's ffn_down (in_features 1,536: whole super-blocks)
    re-encoded from its weights, Q4_K in even layers and Q6_K in odd ones."""
    reader = gguf.GGUFReader(str(bundled_gguf_path()))
    path = tmp_path_factory.mktemp("kquant") / "smollm2-kquant.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama", endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    tensors = []
    for t in reader.tensors:
        data, kind = t.data, t.tensor_type
        if ".ffn_down." in t.name:
            kind = gguf.GGMLQuantizationType.Q4_K if int(t.name.split(".")[1]) % 2 == 0 else gguf.GGMLQuantizationType.Q6_K
            dense = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
            data = _quantize_k(int(kind), dense.astype(np.float32))
        tensors.append((t.name, data, kind))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return path


def test_a_gguf_with_k_quants_decodes_on_its_blocks_and_equals_generate(k_quant_gguf, real_model_dir):
    """A GGUF whose ffn_down layers are Q4_K and Q6_K (the rest Q4_1, the embedding Q8_0),
    as transformers loads it: every layer reads its blocks, and float32 greedy ids of
    mixed prompts decoded together equal HF ``generate`` on the de-quantized model."""
    _kernels_or_skip()
    from transformers import AutoModelForCausalLM

    from pdserve.gguf_weights import read_quantized

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(k_quant_gguf.parent, gguf_file=k_quant_gguf.name, dtype=torch.float32).eval()
    quantized = read_quantized(k_quant_gguf, model.config, set(ops.QUANT_TYPES))
    downs = {quantized[f"model.layers.{i}.mlp.down_proj.weight"].ggml_type for i in range(30)}
    assert downs == {12, 14} and len(quantized) == 30 * 7 + 2
    engine = Engine(model, EngineConfig(num_blocks=64), frozenset(), 4096, quantized=quantized)
    assert engine.model.quantized == {"layers": True, "lm_head": True, "embedding": True}
    assert all(layer.down.quantized and layer.down.weight is None for layer in engine.model.layers)
    ids = load_tokenizer(real_model_dir).encode("The capital of France is Paris. " * 20)
    prompts = [ids[:5], ids[3:43], ids[10:140]]
    seqs = generate_all(engine, prompts, 12)
    for seq, prompt in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == reference_generate(model, prompt, 12, ignore_eos=True)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("which", ["bundled", "k_quants"])
def test_the_header_reader_finds_what_ggufs_reader_finds(which, request):
    """read_header (which skips the vocabulary's arrays) gives gguf.GGUFReader's tensors (name,
    dims, type, data offset) and scalar and string metadata, on the bundled file and on one
    GGUFWriter wrote; a file that is no GGUF, or is cut short, is a ValueError naming that."""
    import mmap

    from pdserve.gguf_weights import read_header

    path = bundled_gguf_path() if which == "bundled" else request.getfixturevalue("k_quant_gguf")
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    meta, infos = read_header(memoryview(data))
    reader = gguf.GGUFReader(str(path))
    assert [(i.name, i.dims, i.ggml_type, i.offset) for i in infos] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset)) for t in reader.tensors]
    scalars = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY}
    assert meta == scalars and meta["general.architecture"] == "llama"
    with pytest.raises(ValueError, match="not a GGUF"):
        read_header(memoryview(b"PK\x03\x04" + bytes(40)))
    with pytest.raises(ValueError, match="cut short"):
        read_header(memoryview(data)[:100_000])


def test_a_gguf_whose_header_is_not_read_serves_dense_weights(tmp_path, caplog):
    """A GGUF the header walker refuses (here: cut short) leaves the pool on the de-quantized
    model, with a warning naming why, rather than failing the replica."""
    from transformers import AutoConfig

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(bundled_gguf_path().read_bytes()[:100_000])
    cfg = ClusterConfig.from_dict({"model": {"path": str(cut)}, "decode": {"weights": "quantized"}})
    config = AutoConfig.for_model("llama")
    with caplog.at_level(logging.WARNING, logger="pdserve.worker"):
        assert quantized_weights(cfg, "decode", config, "float32") is None
    assert "GGUF header cut short" in caplog.text and "dense weights" in caplog.text
