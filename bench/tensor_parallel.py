"""The decode step and a prefill at tensor-parallel sizes 1 and 2: ``bash bench/run.sh tensor_parallel``.

A random Llama checkpoint near the bundled model's size whose heads split in two (hidden 512,
8 heads and 4 KV heads of 64, intermediate 1536, 30 layers, vocab 49,152: 99M parameters;
the bundled model's 9 heads do not), in this machine's default dtype, saved and loaded as a
served model is. Three settings, each one engine, timed in turn:

    tp1-t1   one rank, 1 thread
    tp1-t2   one rank, 2 threads (the kernels' own thread split)
    tp2      two ranks, 1 thread each (each reads half the weights; two all-reduces per layer)

Per setting: the median of three prefills of ``--prompt`` tokens (after three to warm up) and the median decode step at batch 1 and 16
over a context of ``--context`` tokens, with the share of rank 0's step spent in all-reduces
(waits for the slower rank included). The three settings run in turn, ``--rounds`` times; each
ratio is taken within a round and the median over rounds reported with its range (a shared
host's slow spells move single runs by 30% and more). Writes bench/out/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import hardware
from pdserve.config import ClusterConfig
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.model_loader import load_checkpoint, resolve_dtype
from pdserve.sampling import SamplingParams

SHAPE = dict(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
SETTINGS = {"tp1-t1": (1, 1), "tp1-t2": (1, 2), "tp2": (2, 1)}  # name -> (ranks, threads per rank)


def write_checkpoint(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(path)


def measure(path: Path, dtype: str, tp: int, threads: int, prompt: int, context: int, steps: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    engine = Engine(load_checkpoint(path, dtype), EngineConfig(num_blocks=2048, block_size=16, tensor_parallel_size=tp), frozenset(), 4096)
    comm = engine.model.embed.comm if tp > 1 else None
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, SHAPE["vocab_size"], (max(prompt, context) + 64,), generator=gen).tolist()
    out: dict[str, float] = {}
    try:
        prefills, reduce_s = [], 0.0
        for i in range(6):  # three to warm up (each rank's first steps of a size fault in their buffers), three timed
            seq = Sequence(f"p{i}", ids[i : i + prompt][::-1] if i % 2 else ids[i : i + prompt], prompt, SamplingParams(max_tokens=1))
            engine.add(seq)
            before = comm.spent_s if comm else 0.0
            start = time.perf_counter()
            while engine.scheduler.has_work():
                engine.step()
            if i >= 3:
                prefills.append(time.perf_counter() - start)
                reduce_s += (comm.spent_s - before) if comm else 0.0
        out["prefill_s"] = statistics.median(prefills)
        out["prefill_allreduce_fraction"] = reduce_s / sum(prefills)
        for batch in (1, 16):
            seqs = [Sequence(f"b{batch}-{i}", ids[i : i + context], context, SamplingParams(max_tokens=steps + 5, ignore_eos=True))
                    for i in range(batch)]
            for s in seqs:
                engine.add(s)
            while any(s.num_generated == 0 for s in seqs):
                engine.step()
            for _ in range(3):  # warm-up steps of this batch size
                engine.step()
            times, reduce_s = [], 0.0
            for _ in range(steps):
                before = comm.spent_s if comm else 0.0
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
                reduce_s += (comm.spent_s - before) if comm else 0.0
            while engine.scheduler.has_work():
                engine.step()
            out[f"decode_b{batch}_s"] = statistics.median(times)
            out[f"decode_b{batch}_allreduce_fraction"] = reduce_s / sum(times)
    finally:
        engine.close()
    return out


def run(dtype: str, rounds: int = 3, prompt: int = 256, context: int = 256, steps: int = 20) -> dict:
    """Every setting ``rounds`` times, interleaved. Returns the run as written to the JSON:
    per-round figures, medians per setting, and the ratios (median over rounds, with range)."""
    result = {"date": time.strftime("%Y-%m-%d"), **hardware.describe(), "cores": len(os.sched_getaffinity(0)), "dtype": dtype,
              "shape": SHAPE, "prompt": prompt, "context": context}
    per_round: list[dict[str, dict[str, float]]] = []
    threads_before = torch.get_num_threads()  # measure() sets each setting's
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp))
        for r in range(rounds):  # settings interleaved, so a slow spell of a shared host lands on every setting alike
            per_round.append({})
            for name, (tp, threads) in SETTINGS.items():
                per_round[-1][name] = measure(Path(tmp), dtype, tp, threads, prompt, context, steps)
                print(f"tensor parallel round {r}", name, json.dumps({k: round(v, 4) for k, v in per_round[-1][name].items()}), flush=True)
    torch.set_num_threads(threads_before)
    result["rounds"] = per_round
    result["settings"] = {name: {k: statistics.median(rd[name][k] for rd in per_round) for k in per_round[0][name]} for name in SETTINGS}
    pairs = {"decode_b1_tp2_over_tp1_t1": ("decode_b1_s", "tp1-t1"), "decode_b1_tp2_over_tp1_t2": ("decode_b1_s", "tp1-t2"),
             "decode_b16_tp2_over_tp1_t1": ("decode_b16_s", "tp1-t1"), "decode_b16_tp2_over_tp1_t2": ("decode_b16_s", "tp1-t2"),
             "prefill_tp2_over_tp1_t1": ("prefill_s", "tp1-t1"), "prefill_tp2_over_tp1_t2": ("prefill_s", "tp1-t2")}
    # each ratio within one round (the settings measured minutes apart at most), then the median over rounds
    ratios = {key: [rd["tp2"][m] / rd[base][m] for rd in per_round] for key, (m, base) in pairs.items()}
    result["ratios"] = {key: statistics.median(v) for key, v in ratios.items()}
    result["ratios"]["decode_b1_tp2_over_tp1_t1_target"] = 0.6
    result["ratio_ranges"] = {key: [min(v), max(v)] for key, v in ratios.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=256, help="prefill tokens")
    parser.add_argument("--context", type=int, default=256, help="decode context per sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all three settings; medians over rounds")
    parser.add_argument("--out", default="bench/out/tensor_parallel.json")
    args = parser.parse_args()
    result = run(resolve_dtype(ClusterConfig.from_dict({"model": {"dtype": "auto"}})), args.rounds, args.prompt, args.context, args.steps)
    print(json.dumps(result["ratios"], indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
