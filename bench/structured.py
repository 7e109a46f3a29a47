"""What structured output costs a decode step: ``bash bench/run.sh structured``.

One engine (the bundled model, this machine's default dtype) decodes a batch of requests
twice, from the same prompts for the same number of steps: once free (``ignore_eos``), once
with every request constrained by a JSON Schema whose output runs past the steps measured (an
array of at least 200 integers). The figure is the median decode step constrained over free
(the masks are filled on another thread while the forward runs, pdserve/engine/engine.py, and
applied per row before sampling). Beside it: the grammar compile time (cache miss) and the
mask fill time per row, measured alone. Writes bench/out/structured.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench import hardware
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.model_loader import load_model, load_tokenizer, resolve_model_dir
from pdserve.sampling import SamplingParams
from pdserve.structured import Grammars, StructuredOutput, fill_masks
from pdserve.worker import eos_token_ids

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 200}


def step_times(engine: Engine, prompts: list[list[int]], so: StructuredOutput | None, steps: int) -> list[float]:
    """Seconds of each decode step with every request of ``prompts`` running (prefill excluded)."""
    seqs = [Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=steps + 1, ignore_eos=so is None, structured=so))
            for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    while any(seq.num_generated == 0 for seq in seqs):  # the prompts, and each first token
        engine.step()
    times = []
    while engine.scheduler.has_work():
        start = time.perf_counter()
        engine.step()
        if all(seq.finish_reason is None for seq in seqs):
            times.append(time.perf_counter() - start)
    assert all(seq.finish_reason == "length" for seq in seqs), [seq.finish_reason for seq in seqs]
    return times


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU has AVX512-BF16 or AMX, else float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="free and constrained runs, in turn")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hw = hardware.describe()
    dtype = args.dtype
    if dtype == "auto":  # as model.dtype auto settles it on a CPU (pdserve/model_loader.py resolve_dtype)
        from pdserve.engine.cpu import has_bf16_instructions

        dtype = "bfloat16" if has_bf16_instructions() else "float32"
    model_dir = resolve_model_dir(args.model)
    model, tokenizer = load_model(model_dir, dtype), load_tokenizer(model_dir)
    eos = eos_token_ids(model, tokenizer)
    start = time.perf_counter()
    grammars = Grammars(tokenizer, model.config.vocab_size, eos)
    tokenizer_s = time.perf_counter() - start
    so = StructuredOutput("json", json.dumps(SCHEMA))
    start = time.perf_counter()
    grammars.check(so)
    compile_s = time.perf_counter() - start
    matcher = grammars.matcher(so)
    fills = []
    for token in tokenizer.encode("[" + ", ".join(str(i % 100) for i in range(60)), add_special_tokens=False):
        start = time.perf_counter()
        fill_masks([matcher], model.config.vocab_size)
        fills.append(time.perf_counter() - start)
        assert matcher.consume_token(token)

    engine = Engine(model, EngineConfig(num_blocks=64 * args.batch, max_num_seqs=args.batch), eos, 4096, grammars=grammars)
    texts = ["List numbers.", "Write some integers.", "Give me a JSON array.", "Numbers, please.", "Count for me.",
             "Print digits.", "Array of ints:", "Make a list."]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)] + " " * (i // len(texts))}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
               for i in range(args.batch)]
    free, constrained = [], []
    for _ in range(args.repeats):  # in turn, so that a busy minute falls on both
        free += step_times(engine, prompts, None, args.steps)
        constrained += step_times(engine, prompts, so, args.steps)
    result = {
        "date": time.strftime("%Y-%m-%d"), "cpu": hw["cpu"], "cpu_flags": hw["cpu_flags"], "dtype": dtype, "threads": args.threads,
        "batch": args.batch, "grammar_library": "llguidance", "tokenizer_build_s": tokenizer_s, "json_schema_compile_s": compile_s,
        "mask_fill_per_row_s_median": median(fills), "mask_fill_per_row_s_max": max(fills),
        "decode_step_free_s": median(free), "decode_step_constrained_s": median(constrained),
        "constrained_over_free": median(constrained) / median(free), "constrained_over_free_target": 1.10,
    }
    print(f"machine: {hw['cpu']} [{hw['cpu_flags']}], {dtype}, {args.threads} thread(s)")
    print(f"llguidance: tokenizer {tokenizer_s * 1e3:.0f} ms, JSON schema compile {compile_s * 1e3:.2f} ms, "
          f"mask fill per row {median(fills) * 1e6:.0f} us median ({max(fills) * 1e6:.0f} max)")
    print(f"decode step, batch {args.batch}: free {median(free) * 1e3:.1f} ms, every row JSON-constrained "
          f"{median(constrained) * 1e3:.1f} ms: {result['constrained_over_free']:.3f}x (target <= 1.10)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
