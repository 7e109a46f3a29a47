"""What sampling costs a decode step at a large vocabulary: ``bash bench/run.sh sampler``.

An engine over random weights of SmolLM2-135M's shape with Llama 3's vocabulary (128,256)
decodes a batch of 64 greedy requests; the figure is the median step. Beside it, on the same
logits ``[64, 128256]`` float32: the step's batched sampler (pdserve/engine/sampler.py) for
three mixes (greedy; temperature 0.8 + top-k 50 + top-p 0.95, unseeded; the same, seeded:
one generator per row), and the one-row reference (pdserve/sampling.py ``sample``, a Python
loop over rows) for the same mixes. Reports each as a share of the decode step. Writes
bench/out/sampler.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench import hardware
from bench.engine import random_model
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampler import Draw, sample_batch
from pdserve.engine.sequence import Sequence
from pdserve.sampling import SamplingParams, sample

VOCAB = 128256
MIXES = {
    "greedy": SamplingParams(max_tokens=64),
    "top_k_top_p": SamplingParams(max_tokens=64, temperature=0.8, top_k=50, top_p=0.95),
    "top_k_top_p_seeded": SamplingParams(max_tokens=64, temperature=0.8, top_k=50, top_p=0.95, seed=7),
}


def median_s(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_step_s(batch: int, dtype: str, steps: int) -> tuple[float, torch.Tensor]:
    """Median decode step (s) of ``batch`` greedy requests, and one step's logits [batch, vocab]."""
    engine = Engine(random_model(dtype, "cpu", VOCAB), EngineConfig(num_blocks=batch * 16, max_num_seqs=batch), frozenset(), 8192)
    seqs = [Sequence(f"r{i}", [1 + (i * 31 + j) % 1000 for j in range(64)], 64, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
            for i in range(batch)]
    for seq in seqs:
        engine.add(seq)
    while any(seq.num_generated == 0 for seq in seqs):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    logits = engine.runner.forward([(seq, 1) for seq in seqs]).float()  # (recomputes the last token: only its logits are kept)
    return statistics.median(times), logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: this machine's default)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = args.dtype
    if dtype == "auto":  # as model.dtype auto settles it on a CPU (pdserve/model_loader.py resolve_dtype)
        from pdserve.engine.cpu import has_bf16_instructions

        dtype = "bfloat16" if has_bf16_instructions() else "float32"
    step, logits = decode_step_s(args.batch, dtype, args.steps)
    result = {**hardware.describe(), "date": time.strftime("%Y-%m-%d"), "threads": args.threads, "dtype": dtype,
              "batch": args.batch, "vocab": VOCAB, "decode_step_s": step, "mixes": {}}
    for name, params in MIXES.items():
        draws = [Draw(r, params, position=100 + r) for r in range(args.batch)]
        batched = median_s(lambda: sample_batch(logits, draws), 5)
        reference = median_s(lambda: [sample(logits[r], params, position=100 + r) for r in range(args.batch)], 3)
        result["mixes"][name] = {"batched_s": batched, "reference_s": reference, "batched_share_of_step": batched / step,
                                 "reference_share_of_step": reference / step}
        print(f"{name:>18}: batched {batched * 1e3:7.2f} ms ({batched / step:5.1%} of a {step * 1e3:.1f} ms step), "
              f"one-row reference {reference * 1e3:7.2f} ms ({reference / step:5.1%})")
    print(f"machine: {result['cpu']} [{result['cpu_flags']}], {dtype}, {args.threads} thread(s), batch {args.batch}, vocab {VOCAB}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
