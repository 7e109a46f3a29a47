"""Prefill engine -> gRPC (loopback) -> decode engine, block to block, against model.generate."""

import asyncio

import pytest

from conftest import reference_generate, tiny_model
from kv_transfer.client import KVClient
from kv_transfer.server import KVServer
from kv_transfer.paged import PagedKVSink, PagedKVSource
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sequence import Sequence
from pdserve.sampling import SamplingParams
from test_engine import assert_all_blocks_free, random_prompts, run_to_completion

EOS = frozenset({2})


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_kv_goes_from_prefill_blocks_to_decode_blocks(family):
    reference = tiny_model(family)
    prefill = Engine(tiny_model(family), EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=48, chunk_size=32), EOS, 512)
    decode = Engine(tiny_model(family), EngineConfig(num_blocks=64, block_size=4), EOS, 512)
    sender, receiver = KVServer("127.0.0.1", chunk_bytes=512), KVClient("grpc")
    prompts = random_prompts([1, 6, 16, 33, 50], seed=3)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    try:
        # prefill: all prompts batched (and chunked) in the prefill engine
        pre = [Sequence(f"r{i}", list(p), len(p), params, stop_after_first_token=True) for i, p in enumerate(prompts)]
        for seq in pre:
            prefill.add(seq)
        run_to_completion(prefill)
        handles = [
            sender.put(seq.request_id, PagedKVSource(prefill.kv_cache, seq.block_table, len(p), prefill.free_blocks), 30)
            for seq, p in zip(pre, prompts)
        ]
        # decode: reserve blocks, receive into them, continue after the first token
        seqs = []
        for seq, p, handle in zip(pre, prompts, handles):
            blocks = decode.reserve(len(p))
            assert receiver.fetch(handle, PagedKVSink(decode.kv_cache, blocks, len(p)), timeout_s=10) == "grpc"
            seqs.append(Sequence(seq.request_id, [*p, seq.token_ids[-1]], len(p), params, num_computed_tokens=len(p), block_table=blocks))
        for seq in seqs:
            decode.add(seq)
        run_to_completion(decode)
        for seq, p in zip(seqs, prompts):
            assert seq.token_ids[len(p):] == reference_generate(reference, p, 10, ignore_eos=True)
        assert sender.stats()["num_held"] == 0
        assert_all_blocks_free(prefill)
        assert_all_blocks_free(decode)
    finally:
        sender.close()
        receiver.close()


def test_cancelled_prefill_frees_kept_blocks():
    engine = Engine(tiny_model("llama"), EngineConfig(num_blocks=16, block_size=4), EOS, 512)
    loop = EngineLoop(engine)

    async def main():
        seq = Sequence("p", random_prompts([10])[0], 10, SamplingParams(max_tokens=5, ignore_eos=True), stop_after_first_token=True)
        queue = loop.submit(seq)
        await asyncio.wait_for(queue.get(), timeout=30)  # first token: blocks are kept for a hand-off ...
        assert engine.block_manager.num_free_blocks == 13
        loop.abort(seq)  # ... that never happens (the router went away)
        for _ in range(200):
            if engine.block_manager.num_free_blocks == 16:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    loop.close()
    assert_all_blocks_free(engine)
