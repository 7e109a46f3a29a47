"""ModelRunner and DecodeEngine on tiny random-weight models (Llama and Qwen2), against model.generate."""

import asyncio

import pytest
import torch

from conftest import reference_generate, tiny_model
from decode_worker.engine import DecodeEngine
from pdserve.messages import TokenChunk
from pdserve.runner import ModelRunner
from pdserve.sampling import SamplingParams, sample

EOS = frozenset({2})


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 16, 17, 40, 3, 64, 9][:n]
    return [torch.randint(3, 256, (length,), generator=g).tolist() for length in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefill_then_decode_from_transferred_kv_equals_generate(family):
    model = tiny_model(family)
    runner = ModelRunner(model, EOS, 512)
    for prompt in prompts(6):
        ref = reference_generate(model, prompt, 12)
        logits, kv = runner.prefill(prompt)
        assert kv.shape == runner.kv_spec.shape(len(prompt))
        cache = runner.cache_from_kv(kv.clone())  # what decode builds from received KV
        out = [int(logits.argmax())]
        while len(out) < len(ref):
            out.append(int(runner.decode(cache, out[-1]).argmax()))
        assert out == ref


async def _collect(queue: asyncio.Queue) -> list[TokenChunk]:
    chunks = []
    while True:
        item = await asyncio.wait_for(queue.get(), timeout=30)
        assert not isinstance(item, BaseException), item
        chunks.append(item)
        if item.finish_reason:
            return chunks


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_interleaves_requests_and_matches_generate(family):
    model = tiny_model(family)
    runner = ModelRunner(model, EOS, 512)
    engine = DecodeEngine(runner)
    params = SamplingParams(max_tokens=10, ignore_eos=True)

    async def main():
        queues, refs = [], []
        for prompt in prompts(8):
            refs.append(reference_generate(model, prompt, 10))
            logits, kv = runner.prefill(prompt)
            first = sample(logits, params, position=len(prompt))
            queues.append((first, engine.add(f"r{len(queues)}", params, first, kv)))
        results = await asyncio.gather(*(_collect(q) for _, q in queues))
        for (first, _), chunks, ref in zip(queues, results, refs):
            ids = [first] + [t for c in chunks for t in c.token_ids]
            assert ids == ref
            assert chunks[-1].finish_reason == "length"

    asyncio.run(main())
    assert engine.stats() == {"num_running": 0, "num_waiting": 0, "num_steps": 8 * 9, "num_finished": 8, "num_aborted": 0}
    engine.close()


def test_engine_abort_frees_the_request():
    model = tiny_model("llama")
    runner = ModelRunner(model, EOS, 512)
    engine = DecodeEngine(runner)

    async def main():
        logits, kv = runner.prefill(prompts(1)[0])
        queue = engine.add("long", SamplingParams(max_tokens=400, ignore_eos=True), int(logits.argmax()), kv)
        await asyncio.wait_for(queue.get(), timeout=30)
        engine.abort("long")
        for _ in range(100):
            if engine.stats()["num_running"] == 0:
                break
            await asyncio.sleep(0.05)

    asyncio.run(main())
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_aborted"] == 1
    engine.close()


def test_stop_token_is_not_emitted():
    model = tiny_model("llama")
    runner = ModelRunner(model, EOS, 512)
    engine = DecodeEngine(runner)
    prompt = prompts(1)[0]
    ref = reference_generate(model, prompt, 6)

    async def main():
        logits, kv = runner.prefill(prompt)
        params = SamplingParams(max_tokens=20, stop_token_ids=(ref[3],), ignore_eos=True)
        return await _collect(engine.add("s", params, ref[0], kv))

    chunks = asyncio.run(main())
    ids = [ref[0]] + [t for c in chunks for t in c.token_ids]
    assert ids == ref[: ref.index(ref[3])] and chunks[-1].finish_reason == "stop"
    engine.close()
