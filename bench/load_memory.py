"""Peak memory of a replica's model load against the bytes of the weights it keeps.

    bash bench/run.sh load_memory [--model smollm2|DIR] [--dtype bfloat16] [--via checkpoint|transformers]
    bash bench/run.sh load_memory --write-random DIR [--params 1.1e9]   # a random Llama checkpoint to load

One load per process (this one): the resident set (``VmRSS``) is read after a warm-up
load of a tiny model of the same architecture (imports, kernels' self-checks), the peak
(``VmHWM``) is reset (``/proc/self/clear_refs``), the engine's model is built, and the
report is the peak's growth over the start against ``LlamaForCausalLM.weight_bytes()``
(packed linear layers, embedding table, norms). ``--via transformers`` loads as a replica
did before the engine read safetensors itself: the whole transformers model, then the engine.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import struct
import sys
import threading
import time
from pathlib import Path

import torch


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakRSS:
    """The largest VmRSS from ``start()``: the kernel's VmHWM after a reset, else polled every 2 ms."""

    def start(self) -> int:
        self.base = _status("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.polled = None
        except OSError:
            self.polled, self._stop = self.base, threading.Event()
            threading.Thread(target=self._poll, daemon=True).start()
        return self.base

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.polled = max(self.polled, _status("VmRSS"))
            time.sleep(0.002)

    def peak(self) -> int:
        if self.polled is None:
            return _status("VmHWM")
        self._stop.set()
        return max(self.polled, _status("VmRSS"))


def llama_config(params: float):
    """A Llama config of about ``params`` parameters (TinyLlama's shape at 1.1e9, layers scaled)."""
    from transformers import LlamaConfig

    hidden, inter, vocab = 2048, 5632, 32000
    per_layer = hidden * hidden * 2 + 2 * hidden * 256 + 3 * hidden * inter
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                       bos_token_id=1, eos_token_id=2)


def write_random_checkpoint(out: Path, config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Write ``config`` and random weights (a tiled random block, N(0, 0.02)) as one safetensors
    file, streamed tensor by tensor (no model in memory). Returns the bytes written."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    name = {torch.bfloat16: "BF16", torch.float32: "F32"}[dtype]
    header, offset = {}, 0
    for n, shape in shapes.items():
        size = dtype.itemsize * int(torch.Size(shape).numel())
        header[n] = {"dtype": name, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    block = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for n, shape in shapes.items():
            numel = int(torch.Size(shape).numel())
            data = block.repeat(-(-numel // block.numel()))[:numel]
            f.write(data.view(torch.uint8).numpy().tobytes())
    return offset


def build(model_dir: Path, dtype: str, via: str):
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.model_loader import load_checkpoint, load_model

    model = load_checkpoint(model_dir, dtype) if via == "checkpoint" else load_model(model_dir, dtype)
    engine = Engine(model, EngineConfig(num_blocks=4, block_size=16), frozenset({2}), 64)
    return engine, model


def measure(model_dir: Path, dtype: str, via: str) -> dict:
    """Load ``model_dir`` in this process and report its peak RSS growth (bytes) against the weights kept."""
    import tempfile

    from pdserve.model_loader import load_model

    with tempfile.TemporaryDirectory() as tmp:  # warm-up: the same code paths on a tiny model of the architecture
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(model_dir)
        for k, v in dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=256, head_dim=16).items():
            setattr(cfg, k, v)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        load_model(Path(tmp), dtype)
        build(Path(tmp), dtype, via)
    meter = PeakRSS()
    base = meter.start()
    start = time.perf_counter()
    engine, model = build(model_dir, dtype, via)
    seconds = time.perf_counter() - start
    peak = meter.peak()
    kept = engine.model.weight_bytes()
    del model
    return {"model": str(model_dir), "dtype": dtype, "via": via, "rss_before_bytes": base, "peak_growth_bytes": peak - base,
            "weights_kept_bytes": kept, "ratio": round((peak - base) / kept, 3), "load_s": round(seconds, 2),
            "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 (bundled), a .gguf, or a Hugging Face directory")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--via", default="checkpoint", choices=["checkpoint", "transformers"])
    p.add_argument("--write-random", type=Path, help="write a random Llama checkpoint here and exit")
    p.add_argument("--params", type=float, default=1.1e9, help="its parameters (with --write-random)")
    args = p.parse_args(argv)
    if args.write_random:
        print(json.dumps({"wrote": str(args.write_random), "bytes": write_random_checkpoint(args.write_random, llama_config(args.params))}))
        return
    from pdserve.model_loader import resolve_model_dir

    torch.set_num_threads(1)
    print(json.dumps(measure(resolve_model_dir(args.model), args.dtype, args.via)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
