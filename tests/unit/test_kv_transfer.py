"""KV transfer over real gRPC on loopback and real shared memory: round trips, leases,
fingerprints, injected faults, and 500 transfers with random cancellations."""

import asyncio
import random
import time

import pytest
import torch

from conftest import NO_COMPILER, make_tls
from decode_worker.server import receive_kv
from kv_transfer import shm_backend, wire
from kv_transfer.base import KVHandle, TensorKVSink, TensorKVSource
from kv_transfer.client import KVClient
from kv_transfer.grpc_backend import iter_chunks, receive_stream
from kv_transfer.lease import LeaseTable
from kv_transfer.loopback import LoopbackKVReceiver, LoopbackKVSender
from kv_transfer.paged import PagedKVSource
from kv_transfer.server import KVServer
from kv_transfer.shm_backend import ShmPoolMemory
from pdserve.engine import cpu
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.errors import KVAuthError, KVIncompatibleError, KVNotFoundError, KVTransferError
from pdserve.kv_fingerprint import KVFingerprint
from pdserve.kv_layout import KVSpec
from pdserve.rpc import kv_pb2

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
NODE = "node-a"
needs_shm = pytest.mark.skipif(cpu.compiler() is None, reason=NO_COMPILER)  # with a compiler, a failed build fails these


def random_kv(spec: KVSpec, num_tokens: int) -> TensorKVSource:
    """kv: [num_layers, 2, kv_heads, num_tokens, head_dim]"""
    shape = (spec.num_layers, 2, spec.num_kv_heads, num_tokens, spec.head_dim)
    return TensorKVSource(torch.randn(shape).to(spec.dtype))


def fetch(receiver, handle, spec, timeout_s=10):
    sink = TensorKVSink(spec, handle.num_tokens)
    receiver.fetch(handle, sink, timeout_s)
    return sink.kv


@pytest.fixture
def sender():
    s = KVServer("127.0.0.1", chunk_bytes=1024, node_id=NODE)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 17, 300])
def test_grpc_round_trip_is_bit_exact_and_acknowledged(sender, dtype, num_tokens):
    spec = KVSpec(3, 2, 8, dtype)
    receiver = KVClient("grpc", node_id=NODE)
    source = random_kv(spec, num_tokens)
    handle = sender.put("req-1", source, lease_s=30)
    got = fetch(receiver, handle, spec)  # chunk_bytes=1024: many chunks per layer
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), source.kv.view(torch.uint8))
    # the fetch acknowledged it: the sender has already let go
    assert sender.stats() == {"num_held": 0, "bytes_held": 0, "num_released": 1, "num_expired": 0}
    assert sender.pop_finished() == [("req-1", "released")] and sender.pop_finished() == []
    with pytest.raises(KVNotFoundError):
        fetch(receiver, handle, spec)
    assert receiver.release(handle, timeout_s=5) is False
    assert receiver.stats()["num_fetched_grpc"] == 1
    receiver.close()


def test_chunks_respect_the_byte_budget_and_are_standard_protobuf():
    source = random_kv(SPEC, 100)
    messages = list(iter_chunks("x", source, chunk_bytes=1024, block_size=16))
    header = messages[0].header
    chunks = [kv_pb2.FetchKVResponse.FromString(m).chunk for m in messages[1:]]  # the stock parser reads them
    views = [wire.decode_response(m) for m in messages[1:]]  # and so does the zero-copy one, the same way
    assert header.num_chunks == len(chunks) > SPEC.num_layers and header.block_size == 16
    assert all(len(c.key) + len(c.value) <= 1024 for c in chunks)
    assert sum(c.num_tokens for c in chunks) == 100 * SPEC.num_layers
    for c, v in zip(chunks, views):
        assert (c.layer, c.start_token, c.num_tokens, c.key, c.value, c.xxh3) == (v.layer, v.start_token, v.num_tokens, bytes(v.key), bytes(v.value), v.xxh3)
    first = chunks[0]
    assert first.key == source.kv[0, 0, :, : first.num_tokens].contiguous().view(torch.uint8).numpy().tobytes()


def test_a_short_prompt_goes_in_groups_of_whole_layers():
    spec = KVSpec(num_layers=7, num_kv_heads=2, head_dim=8, dtype=torch.float32)  # 128 bytes per layer-token
    source = random_kv(spec, 3)
    messages = list(iter_chunks("x", source, chunk_bytes=1024, block_size=16))  # 2 layers of 3 tokens per chunk
    chunks = [wire.decode_response(m) for m in messages[1:]]
    assert messages[0].header.num_chunks == len(chunks) == 4
    assert [(c.layer, c.num_layers, c.start_token, c.num_tokens) for c in chunks] == [(0, 2, 0, 3), (2, 2, 0, 3), (4, 2, 0, 3), (6, 0, 0, 3)]
    assert kv_pb2.FetchKVResponse.FromString(messages[1]).chunk.num_layers == 2  # the stock parser reads the field
    sink = TensorKVSink(spec, 3)
    handle = KVHandle("grpc", "addr", "x", 3)
    receive_stream(iter(wire.decode_response(m) if i else m for i, m in enumerate(messages)), handle, sink, None)
    assert torch.equal(sink.kv, source.kv)


def test_lease_expires_and_frees(sender):
    receiver = KVClient("grpc")
    handle = sender.put("req-2", random_kv(SPEC, 5), lease_s=0.2)
    time.sleep(1.0)  # the reaper runs every 0.5 s
    assert sender.stats()["num_held"] == 0 and sender.stats()["num_expired"] == 1
    assert sender.pop_finished() == [("req-2", "expired")]
    with pytest.raises(KVNotFoundError, match="released or lease expired"):
        fetch(receiver, handle, SPEC)
    receiver.close()


def test_lease_table_refuses_a_duplicate_id():
    table = LeaseTable()
    table.hold("a", random_kv(SPEC, 1), 10)
    with pytest.raises(KeyError):
        table.hold("a", random_kv(SPEC, 1), 10)
    table.close()


class _CountedSource:
    nbytes = 64

    def __init__(self):
        self.num_released = 0

    def release(self):
        self.num_released += 1


def test_a_release_that_overtakes_its_hold_frees_the_kv_at_once():
    """A cancel by request id can reach prefill before its lease is put (the router never saw
    the handle): the hold that follows frees the KV at once, counted as released, not expired."""
    table = LeaseTable(early_release_s=0.5)
    assert table.release("early") is False
    early = _CountedSource()
    table.hold("early", early, 30)
    assert early.num_released == 1 and table.stats() == {"num_held": 0, "bytes_held": 0, "num_released": 1, "num_expired": 0}
    assert table.pop_finished() == [("early", "released")]
    again = _CountedSource()  # remembered once: the same id held again is held
    table.hold("early", again, 30)
    assert again.num_released == 0 and table.stats()["num_held"] == 1
    table.release("late")
    time.sleep(0.6)  # remembered for early_release_s only
    late = _CountedSource()
    table.hold("late", late, 30)
    assert late.num_released == 0 and table.stats()["num_held"] == 2
    table.close()
    assert again.num_released == 1 and late.num_released == 1


@pytest.mark.parametrize(
    "field, spec",
    [
        ("num_layers", KVSpec(4, 2, 8, torch.float32)),
        ("num_kv_heads", KVSpec(3, 1, 8, torch.float32)),
        ("head_dim", KVSpec(3, 2, 16, torch.float32)),
        ("dtype", KVSpec(3, 2, 8, torch.bfloat16)),
    ],
)
def test_layout_mismatch_names_the_field(sender, field, spec):
    handle = sender.put("req-3", random_kv(SPEC, 4), lease_s=30)
    receiver = KVClient("grpc")
    with pytest.raises(KVTransferError, match=field):
        fetch(receiver, handle, spec)
    receiver.close()


def test_unreachable_sender_is_a_transfer_error():
    receiver = KVClient("grpc")
    with pytest.raises(KVTransferError, match="UNAVAILABLE|DEADLINE"):
        fetch(receiver, KVHandle("grpc", "127.0.0.1:1", "nope", 4), SPEC, timeout_s=2)
    receiver.close()


# -- the KV channel's shared secret (security.kv_secret) ----------------------------------


def test_a_fetch_without_the_secret_or_for_another_id_gets_nothing():
    sender = KVServer("127.0.0.1", chunk_bytes=1024, node_id=NODE, secret="right", fingerprint=FP)
    source = random_kv(SPEC, 40)
    handle = sender.put("req-s", source, lease_s=30)
    for secret in (None, "wrong"):
        receiver = KVClient("grpc", fingerprint=FP, node_id=NODE, secret=secret)
        with pytest.raises(KVAuthError, match="UNAUTHENTICATED|shared secret"):
            fetch(receiver, handle, SPEC)
        with pytest.raises(KVTransferError, match="UNAUTHENTICATED"):  # nor can it free someone's KV
            receiver.release(handle, timeout_s=5)
        receiver.close()
    assert sender.stats()["num_held"] == 1  # refused before any handler ran: the lease is untouched
    receiver = KVClient("grpc", fingerprint=FP, node_id=NODE, secret="right")
    with pytest.raises(KVNotFoundError):  # the right secret and a wrong transfer id: nothing either
        fetch(receiver, KVHandle("grpc", handle.address, "req-other", 40, NODE, "", handle.instance_id), SPEC)
    got = fetch(receiver, handle, SPEC)
    assert torch.equal(got, source.kv) and sender.stats()["num_held"] == 0
    receiver.close()
    sender.close()


def test_kv_over_tls_with_the_secret_and_a_plaintext_client_gets_nothing(tmp_path):
    cert, key, ca = make_tls(tmp_path)
    sender = KVServer("127.0.0.1", chunk_bytes=4096, node_id=NODE, secret="s", tls_cert_file=cert, tls_key_file=key)
    source = random_kv(SPEC, 64)
    handle = sender.put("req-tls", source, lease_s=30)
    plaintext = KVClient("grpc", node_id=NODE, secret="s")
    with pytest.raises(KVTransferError, match="UNAVAILABLE|DEADLINE"):
        fetch(plaintext, handle, SPEC, timeout_s=3)
    plaintext.close()
    assert sender.stats()["num_held"] == 1
    receiver = KVClient("grpc", node_id=NODE, secret="s", tls_ca_file=ca)
    assert torch.equal(fetch(receiver, handle, SPEC), source.kv) and sender.stats()["num_held"] == 0
    receiver.close()
    sender.close()


# -- fingerprints ------------------------------------------------------------------

FP = KVFingerprint("smollm2", "w" * 32, "float32", 3, 2, 8, 16, "t" * 32)
OTHER = {"model_id": "llama", "weights_hash": "x" * 32, "dtype": "bfloat16", "num_layers": 4, "num_kv_heads": 1,
         "head_dim": 16, "block_size": 32, "tokenizer_hash": "y" * 32}


@pytest.mark.parametrize("field", list(OTHER))
def test_incompatible_prefill_worker_is_refused_naming_the_field(field):
    sender = KVServer("127.0.0.1", fingerprint=KVFingerprint(**{**FP.to_dict(), field: OTHER[field]}))
    receiver = KVClient("grpc", fingerprint=FP)
    try:
        handle = sender.put("req-fp", random_kv(SPEC, 4), lease_s=30)
        with pytest.raises(KVIncompatibleError, match=field) as info:
            fetch(receiver, handle, SPEC)
        assert info.value.field == field
        assert receiver.release(handle, 5) and sender.stats()["num_held"] == 0
        # loopback checks the same way
        lb_sender, lb_receiver = LoopbackKVSender(sender.fingerprint), LoopbackKVReceiver(FP)
        with pytest.raises(KVIncompatibleError, match=field):
            fetch(lb_receiver, lb_sender.put("x", random_kv(SPEC, 2), 30), SPEC)
        lb_sender.close()
    finally:
        receiver.close()
        sender.close()


def test_matching_fingerprints_handshake_once_per_sender_instance():
    sender = KVServer("127.0.0.1", fingerprint=FP)
    receiver = KVClient("grpc", fingerprint=FP)
    try:
        for i in range(3):
            fetch(receiver, sender.put(f"r{i}", random_kv(SPEC, 3), 30), SPEC)
        assert receiver._verified == {(sender.address, sender.instance_id)}
    finally:
        receiver.close()
        sender.close()


# -- faults ------------------------------------------------------------------------

@pytest.mark.parametrize("kind, error, match", [
    ("timeout", KVTransferError, "DEADLINE_EXCEEDED"),
    ("break", KVTransferError, "UNAVAILABLE"),
    ("corrupt", KVTransferError, "checksum"),
    ("expire", KVNotFoundError, "released or lease expired"),
])
def test_grpc_faults_are_detected_and_nothing_is_held_after_release(sender, kind, error, match):
    receiver = KVClient("grpc")
    sender.faults.stall_s = 3.0
    sender.faults.arm(kind)
    handle = sender.put(f"f-{kind}", random_kv(SPEC, 100), lease_s=30)
    time.sleep(0.6 if kind == "expire" else 0)  # let the reaper take the expired lease
    with pytest.raises(error, match=match):
        fetch(receiver, handle, SPEC, timeout_s=1.0)
    receiver.release(handle, 5)  # what a decode worker does after a failed fetch
    assert sender.stats()["num_held"] == 0
    receiver.close()


# -- shm -------------------------------------------------------------------------------

def paged_pair(tmp_path, num_blocks=64, block_size=4, spec=SPEC):
    """(prefill pool in a shm file + its block manager, decode pool + its block manager)"""
    src = PagedKVCache(spec, num_blocks, block_size, memory=ShmPoolMemory(str(tmp_path / "pool"), spec, num_blocks, block_size))
    dst = PagedKVCache(spec, num_blocks, block_size)
    return (src, BlockManager(num_blocks, block_size)), (dst, BlockManager(num_blocks, block_size))


def fill_prompt(cache: PagedKVCache, manager: BlockManager, num_tokens: int) -> list[int]:
    blocks = manager.allocate_blocks(manager.num_blocks_for(num_tokens))
    slots = cache.slots(blocks, 0, num_tokens)
    for layer in range(cache.spec.num_layers):
        shape = (cache.spec.num_kv_heads, num_tokens, cache.spec.head_dim)
        cache.write(layer, slots, torch.randn(shape).to(cache.spec.dtype), torch.randn(shape).to(cache.spec.dtype))
    return blocks


@needs_shm
@pytest.mark.parametrize("mode", ["shm", "auto"])
@pytest.mark.parametrize("num_tokens", [1, 4, 37])
def test_shm_copies_block_to_block_bit_exact(tmp_path, mode, num_tokens):
    (src, src_mgr), (dst, dst_mgr) = paged_pair(tmp_path)
    sender = KVServer("127.0.0.1", backend=mode, block_size=4, shm_path=src.shm_path, node_id=NODE)
    receiver = KVClient(mode, node_id=NODE)
    try:
        blocks = fill_prompt(src, src_mgr, num_tokens)
        handle = sender.put("s1", PagedKVSource(src, blocks, num_tokens, src_mgr.free_blocks), 30)
        dst_blocks = dst_mgr.allocate_blocks(dst_mgr.num_blocks_for(num_tokens))
        assert asyncio.run(receive_kv(dst, receiver, handle, dst_blocks, num_tokens, 10)) == ("shm", None)
        for layer in range(SPEC.num_layers):
            want = src.read(layer, src.slots(blocks, 0, num_tokens))
            got = dst.read(layer, dst.slots(dst_blocks, 0, num_tokens))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert src_mgr.num_free_blocks == src_mgr.num_blocks  # acknowledged: prefill's blocks are free
        assert sender.stats()["num_held"] == 0 and receiver.stats()["num_fetched_shm"] == 1
        # any sink works too (token rows), checked against the sender's checksums
        blocks = fill_prompt(src, src_mgr, num_tokens)
        handle = sender.put("s2", PagedKVSource(src, blocks, num_tokens, src_mgr.free_blocks), 30)
        got = fetch(receiver, handle, SPEC)
        assert torch.equal(got[0, 0], src.read(0, src.slots(blocks, 0, num_tokens))[0])
    finally:
        receiver.close()
        sender.close()
        src.close()


@needs_shm
def test_auto_uses_grpc_for_another_node_and_shm_refuses_it(tmp_path):
    (src, src_mgr), (dst, dst_mgr) = paged_pair(tmp_path)
    sender = KVServer("127.0.0.1", backend="auto", block_size=4, shm_path=src.shm_path, node_id="node-b")
    auto, shm = KVClient("auto", node_id=NODE), KVClient("shm", node_id=NODE)
    try:
        blocks = fill_prompt(src, src_mgr, 9)
        handle = sender.put("x1", PagedKVSource(src, blocks, 9, src_mgr.free_blocks), 30)
        assert auto.transport_for(handle) == "grpc"
        with pytest.raises(KVTransferError, match="another node"):
            fetch(shm, handle, SPEC)
        dst_blocks = dst_mgr.allocate_blocks(3)
        assert asyncio.run(receive_kv(dst, auto, handle, dst_blocks, 9, 10)) == ("grpc", None)
        assert torch.equal(dst.read(2, dst.slots(dst_blocks, 0, 9))[1], src.read(2, src.slots(blocks, 0, 9))[1])
    finally:
        auto.close()
        shm.close()
        sender.close()
        src.close()


@needs_shm
@pytest.mark.parametrize("kind, error, match", [
    ("timeout", KVTransferError, "DEADLINE_EXCEEDED"),
    ("break", KVTransferError, "UNAVAILABLE"),
    ("corrupt", KVTransferError, "checksum"),
    ("expire", KVNotFoundError, "released or lease expired"),
])
def test_shm_faults_are_detected(tmp_path, kind, error, match):
    (src, src_mgr), (dst, dst_mgr) = paged_pair(tmp_path)
    sender = KVServer("127.0.0.1", backend="shm", block_size=4, shm_path=src.shm_path, node_id=NODE)
    receiver = KVClient("shm", node_id=NODE)
    try:
        sender.faults.stall_s = 3.0
        sender.faults.arm(kind)
        blocks = fill_prompt(src, src_mgr, 20)
        handle = sender.put("f", PagedKVSource(src, blocks, 20, src_mgr.free_blocks), 30)
        time.sleep(0.6 if kind == "expire" else 0)
        dst_blocks = dst_mgr.allocate_blocks(5)
        with pytest.raises(error, match=match):
            asyncio.run(receive_kv(dst, receiver, handle, dst_blocks, 20, 1.0))
        receiver.release(handle, 5)
        assert sender.stats()["num_held"] == 0 and src_mgr.num_free_blocks == src_mgr.num_blocks
    finally:
        receiver.close()
        sender.close()
        src.close()


# -- ownership under random cancellation --------------------------------------------------

@pytest.mark.parametrize("mode", ["grpc", pytest.param("shm", marks=needs_shm)])
def test_500_transfers_with_random_cancellations_leave_nothing_held(tmp_path, mode):
    """Each transfer is cancelled at a random stage (before the fetch, during it, after
    it), fails by an injected fault, or completes; afterwards both pools have every
    block free and the sender holds no lease."""
    spec = KVSpec(4, 2, 16, torch.bfloat16)
    (src, src_mgr), (dst, dst_mgr) = paged_pair(tmp_path, num_blocks=256, block_size=4, spec=spec)
    sender = KVServer("127.0.0.1", backend=mode, chunk_bytes=2048, block_size=4, shm_path=src.shm_path, node_id=NODE)
    sender.faults.stall_s = 0.3
    receiver = KVClient(mode, node_id=NODE)
    rng = random.Random(0)
    outcomes: dict[str, int] = {}

    async def one(i: int) -> None:
        num_tokens = rng.randint(1, 120)
        stage = rng.choice(["complete", "before_fetch", "during_fetch", "after_fetch", "fault"])
        if stage == "fault":
            sender.faults.arm(rng.choice(["timeout", "break", "corrupt", "expire"]))
        blocks = fill_prompt(src, src_mgr, num_tokens)
        handle = sender.put(f"t{i}", PagedKVSource(src, blocks, num_tokens, src_mgr.free_blocks), lease_s=0.05 if stage == "fault" else 30)
        if stage == "before_fetch":  # the client left while prefill ran: the router releases
            await asyncio.to_thread(receiver.release, handle, 5)
            outcomes[stage] = outcomes.get(stage, 0) + 1
            return
        dst_blocks = dst_mgr.allocate_blocks(dst_mgr.num_blocks_for(num_tokens))
        task = asyncio.ensure_future(receive_kv(dst, receiver, handle, dst_blocks, num_tokens, 0.25))
        if stage == "during_fetch":
            await asyncio.sleep(rng.random() * 0.003)
            task.cancel()
        try:
            await task
            result = "ok"
        except asyncio.CancelledError:
            result = "cancelled"
        except KVTransferError:
            result = "failed"
        if result != "ok":
            await asyncio.to_thread(receiver.release, handle, 5)
        dst_mgr.free_blocks(dst_blocks)  # decode frees its blocks when the request ends, whatever happened
        outcomes[f"{stage}:{result}"] = outcomes.get(f"{stage}:{result}", 0) + 1

    async def main():
        for start in range(0, 500, 10):
            await asyncio.gather(*(one(i) for i in range(start, start + 10)))

    try:
        asyncio.run(main())
        time.sleep(0.6)  # the reaper takes leases that expired without a fetch
        assert sender.stats()["num_held"] == 0, outcomes
        assert src_mgr.num_free_blocks == src_mgr.num_blocks, outcomes
        assert dst_mgr.num_free_blocks == dst_mgr.num_blocks, outcomes
        assert outcomes.get("complete:ok", 0) > 50 and outcomes.get("during_fetch:cancelled", 0) > 10, outcomes
        assert sum(outcomes.values()) == 500
    finally:
        receiver.close()
        sender.close()
        src.close()


@needs_shm
def test_mappings_of_removed_pools_are_dropped(tmp_path):
    """A decode worker must not keep a stopped prefill worker's pool memory alive."""
    from kv_transfer.shm_backend import ShmReader

    reader = ShmReader()
    old = PagedKVCache(SPEC, 8, 4, memory=ShmPoolMemory(str(tmp_path / "old"), SPEC, 8, 4))
    new = PagedKVCache(SPEC, 8, 4, memory=ShmPoolMemory(str(tmp_path / "new"), SPEC, 8, 4))
    reader._map(old.shm_path, SPEC, 8, 4)
    old.close()  # the sender shut down and removed its file
    reader._map(new.shm_path, SPEC, 8, 4)
    assert list(reader._maps) == [new.shm_path]
    new.close()


@needs_shm
@pytest.mark.parametrize("num_blocks", [8, 600])  # per head 16 KiB (a cached memcpy) and 1.2 MiB (streaming stores)
def test_the_shm_block_copy_lands_every_byte_and_its_checksum_is_the_senders(num_blocks):
    from pdserve.engine import cpu as kernels

    lib = kernels.load("kv_blocks")
    heads, pool_blocks, block_bytes = 3, 1200, 2048  # bf16 blocks of 16 tokens x 64 dims
    gen = torch.Generator().manual_seed(num_blocks)
    src = torch.randint(0, 256, (heads, pool_blocks, block_bytes), dtype=torch.uint8, generator=gen)
    dst = torch.zeros_like(src)
    src_ids = torch.randperm(pool_blocks, generator=gen)[:num_blocks].to(torch.int32)
    dst_ids = torch.randperm(pool_blocks, generator=gen)[:num_blocks].to(torch.int32)
    stride = pool_blocks * block_bytes
    got = lib.kv_copy_blocks_checksum(src.data_ptr(), stride, dst.data_ptr(), stride, block_bytes,
                                      src_ids.data_ptr(), dst_ids.data_ptr(), num_blocks, heads, 7)
    assert torch.equal(dst[:, dst_ids.long()], src[:, src_ids.long()])
    assert got == lib.kv_checksum_blocks(src.data_ptr(), stride, block_bytes, src_ids.data_ptr(), num_blocks, heads, 7)
    assert got == lib.kv_checksum_blocks(dst.data_ptr(), stride, block_bytes, dst_ids.data_ptr(), num_blocks, heads, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_pieces_equal_read_whether_blocks_are_in_runs_or_scattered(dtype):
    from kv_transfer.paged import MAX_RUNS

    spec = KVSpec(2, 3, 8, dtype)
    cache = PagedKVCache(spec, 64, 4)
    cache.k.copy_(torch.randn(cache.k.shape).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape).to(dtype))
    scattered = list(range(63, 3, -3))[:20]  # 20 blocks, no two consecutive: more than MAX_RUNS runs, gathered
    assert len(scattered) > MAX_RUNS
    for table in (list(range(20)), scattered):  # one run of blocks: views of the pool; scattered: one gathered copy
        source = PagedKVSource(cache, table, 77, lambda blocks: None)
        for layer in range(2):
            for start, end in ((0, 77), (16, 50)):
                key, value = source.pieces(layer, start, end)
                k, v = source.read(layer, start, end)
                assert b"".join(key) == k.contiguous().view(torch.uint8).numpy().tobytes()
                assert b"".join(value) == v.contiguous().view(torch.uint8).numpy().tobytes()


def test_the_router_releases_a_lease_at_the_replica_that_holds_it():
    """Of two prefill replicas' KV servers, the router's release (a client left before decode
    fetched) reaches the one that holds the lease, over the KV channel, not a Ray Serve pick."""
    import asyncio

    from router.request_path import RequestPath
    from router.retries import RetryPolicy

    replicas = [KVServer("127.0.0.1", node_id=NODE) for _ in range(2)]
    handles = [server.put(f"req-{i}", random_kv(SPEC, 3), lease_s=30) for i, server in enumerate(replicas)]
    receiver = KVClient("grpc")
    no_retries = RetryPolicy(0, 0.0, False, 0.0)
    path = RequestPath(None, None, no_retries, no_retries, kv_releaser=receiver)

    async def release_second():
        path._release(handles[1])
        await asyncio.wait_for(asyncio.gather(*path._background), 10)

    asyncio.run(release_second())
    assert [server.stats()["num_held"] for server in replicas] == [1, 0]
    assert replicas[1].stats()["num_released"] == 1 and replicas[1].pop_finished() == [("req-1", "released")]
    receiver.close()
    for server in replicas:
        server.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_ipc_checksums_catch_a_changed_word_and_swapped_blocks_per_layer(dtype):
    """kv_transfer/cuda_ipc_backend.py ``layer_checksums``, on the CPU device (the same torch
    ops a GPU runs): one int64 per layer, computed with no host sync, fixed64-sized; a word
    changed in one layer changes that layer's sum alone, and blocks in another order change
    every layer's."""
    from kv_transfer.cuda_ipc_backend import layer_checksums

    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(3, 2, 64, 8, generator=gen).to(dtype) for _ in range(2))  # [layers, kv_heads, slots, head_dim]
    ids = torch.tensor([5, 1, 9])
    sums = layer_checksums(k, v, ids, 4)
    assert sums.dtype == torch.int64 and sums.shape == (3,) and bool((sums >= 0).all())
    assert torch.equal(sums, layer_checksums(k.clone(), v.clone(), ids, 4))
    changed = v.clone()
    changed[1, 1, 9 * 4 + 3, 7] += 1  # layer 1, the last block's last token
    assert (layer_checksums(k, changed, ids, 4) != sums).tolist() == [False, True, False]
    assert (layer_checksums(k, v, torch.tensor([1, 5, 9]), 4) != sums).all()
