"""Layer-wise KV streaming (kv_transfer/progress.py) on tiny random-weight models: each
layer goes out as prefill writes it, chunked prompts included, exactly; a preemption or
abort stops the readers before the blocks are freed; nothing leaks."""

import threading
import time

import pytest

from conftest import reference_generate, tiny_model
from kv_transfer.client import KVClient
from kv_transfer.paged import PagedKVSink
from kv_transfer.progress import KVNotReadyError, LayerProgress, StreamedKVSource
from kv_transfer.server import KVServer
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sequence import Sequence
from pdserve.errors import KVTransferError
from pdserve.sampling import SamplingParams
from test_engine import assert_all_blocks_free, random_prompts, run_to_completion

EOS = frozenset({2})


def test_waits_end_on_mark_failure_deadline_or_a_receiver_that_left():
    progress = LayerProgress(num_layers=2, num_tokens=10)
    threading.Timer(0.05, progress.mark, args=(0, 10)).start()
    progress.wait_layer(0, 10, time.monotonic() + 5)  # returns once marked
    with pytest.raises(KVNotReadyError, match="not ready in time"):
        progress.wait_layer(1, 10, time.monotonic() + 0.05)
    with pytest.raises(KVNotReadyError, match="receiver left"):
        progress.wait_first_token(time.monotonic() + 5, alive=lambda: False)
    threading.Timer(0.05, progress.fail, args=("preempted",)).start()
    with pytest.raises(KVNotReadyError, match="preempted"):
        progress.wait_layer(1, 10, time.monotonic() + 5)


def test_a_copy_in_progress_holds_off_the_free_and_later_copies_fail():
    """``fail`` (called before the engine frees the blocks) waits for a reader's copy."""
    progress = LayerProgress(num_layers=1, num_tokens=4)
    source = StreamedKVSource.__new__(StreamedKVSource)
    source.progress = progress
    order = []
    with source.reading():
        freer = threading.Thread(target=lambda: (progress.fail("preempted"), order.append("freed")))
        freer.start()
        time.sleep(0.1)
        order.append("copied")
    freer.join(5)
    assert order == ["copied", "freed"]
    with pytest.raises(KVNotReadyError, match="preempted"):
        with source.reading():
            pass


def streamed(engine: Engine, prompt: list[int], request_id: str) -> tuple[Sequence, StreamedKVSource]:
    seq = Sequence(request_id, list(prompt), len(prompt), SamplingParams(max_tokens=10, ignore_eos=True), stop_after_first_token=True)
    seq.kv_progress = LayerProgress(engine.kv_spec.num_layers, len(prompt))
    return seq, StreamedKVSource(engine.kv_cache, seq, engine.free_blocks, seq.kv_progress)


def fetch_in_thread(receiver: KVClient, handle, sink) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(_try(receiver.fetch, handle, sink, 10)))
    thread.start()
    return thread, result


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - returned for the test to assert on
        return e


@pytest.mark.parametrize("family,tp", [("llama", 1), ("qwen2", 1), ("llama", 2)])
def test_a_chunked_prompt_streamed_while_it_computes_is_exact(family, tp):
    """The fetch starts before prefill's first step; chunks of 16 tokens, 3 steps; decode
    then continues from the streamed first token and matches the reference. At TP=2 a layer
    is marked stored once both ranks have stored their heads of it."""
    prefill = Engine(tiny_model(family), EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16, chunk_size=16,
                                                      tensor_parallel_size=tp), EOS, 512)
    decode = Engine(tiny_model(family), EngineConfig(num_blocks=64, block_size=4), EOS, 512)
    sender, receiver = KVServer("127.0.0.1", chunk_bytes=1024, block_size=4), KVClient("grpc")
    (prompt,) = random_prompts([45], seed=5)
    try:
        seq, source = streamed(prefill, prompt, "s1")
        handle = sender.put("s1", source, 30)
        blocks = decode.reserve(len(prompt))
        sink = PagedKVSink(decode.kv_cache, blocks, len(prompt))
        thread, result = fetch_in_thread(receiver, handle, sink)
        prefill.add(seq)
        run_to_completion(prefill)  # three chunks; the receiver takes each layer as it is written
        assert source.own()
        thread.join(10)
        assert result == ["grpc"] and sink.first_token == seq.token_ids[-1]
        dec = Sequence("s1", [*prompt, sink.first_token], len(prompt), SamplingParams(max_tokens=10, ignore_eos=True),
                       num_computed_tokens=len(prompt), block_table=blocks)
        decode.add(dec)
        run_to_completion(decode)
        assert dec.token_ids[len(prompt):] == reference_generate(tiny_model(family), prompt, 10, ignore_eos=True)
        assert sender.stats()["num_held"] == 0  # acknowledged
        assert_all_blocks_free(prefill)
        assert_all_blocks_free(decode)
    finally:
        sender.close()
        receiver.close()
        prefill.close()


def test_a_preempted_stream_stops_its_reader_and_the_blocks_are_freed_once():
    """A prompt preempted mid-prefill (blocks freed, recomputed later): the fetch fails
    instead of reading reused blocks; the decode side releases the lease; when prefill ends
    the blocks are not the lease's (``own`` is False) and go back once."""
    prefill = Engine(tiny_model("llama"), EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16, chunk_size=16), EOS, 512)
    sender, receiver = KVServer("127.0.0.1", chunk_bytes=1024, block_size=4), KVClient("grpc")
    (prompt,) = random_prompts([45], seed=6)
    try:
        seq, source = streamed(prefill, prompt, "p1")
        handle = sender.put("p1", source, 30)
        receive_blocks = prefill.reserve(len(prompt))  # the receiver's blocks (same pool here)
        sink = PagedKVSink(prefill.kv_cache, receive_blocks, len(prompt))
        prefill.add(seq)
        prefill.step()  # tokens [0, 16) of every layer
        thread, result = fetch_in_thread(receiver, handle, sink)
        time.sleep(0.3)  # the reader sent the first chunks and waits for tokens 16+
        with prefill.lock:
            prefill.scheduler.preempt(seq)
        thread.join(10)
        assert isinstance(result[0], KVTransferError) and "preempted" in str(result[0])
        assert receiver.release(handle, 5)  # as decode does on a fault
        run_to_completion(prefill)  # recomputed from scratch, finishes
        assert seq.num_preemptions == 1 and not source.own()
        prefill.free_blocks(seq.block_table)  # as the prefill worker does when own() is False
        prefill.free_blocks(receive_blocks)
        assert sender.stats()["num_held"] == 0
        assert_all_blocks_free(prefill)
    finally:
        sender.close()
        receiver.close()
