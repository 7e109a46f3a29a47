"""Prefill and decode engines of one node taking turns (pdserve/core_share.py): the words they
set, decode waiting for a prefill step and its bound, prefill waiting for a running decode
step, words of dead or hung engines and of other nodes, the config key, and the two workers
together with the real model (ids as HF's, the waits counted, nothing left behind).
EngineLoop's gate itself: tests/unit/test_engine.py."""

import asyncio
import multiprocessing as mp
import os
import signal
import struct
import threading
import time

import pytest

from conftest import reference_generate
from decode_worker.server import DecodeServer
from pdserve import core_share
from pdserve.config import ClusterConfig, ConfigError
from pdserve.core_share import CoreShare
from pdserve.messages import PrefillRequest, WithKV
from pdserve.model_loader import load_model, load_tokenizer
from pdserve.sampling import SamplingParams
from prefill_worker.server import PrefillServer


def _busy_child(directory, node, role, ready, release):
    gate = CoreShare(node, role, 60, directory)
    gate.before_step()  # no engine of the other role: marks the step at once
    ready.set()
    release.wait(60)
    gate.after_step()
    ready.clear()
    release.wait(60)  # stays alive (its word too) until killed
    gate.close()


def start_child(tmp_path, role):
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_busy_child, args=(tmp_path, "node-a", role, ready, release), daemon=True)
    proc.start()
    assert ready.wait(60)
    return proc, release


@pytest.fixture
def prefill_child(tmp_path):
    proc, release = start_child(tmp_path, "prefill")
    yield proc, release
    proc.kill()
    proc.join(10)


@pytest.mark.parametrize("waiter_role,child_role", [("decode", "prefill"), ("prefill", "decode")])
def test_an_engine_waits_for_the_other_roles_step_in_another_process_until_it_ends(tmp_path, waiter_role, child_role):
    """decode waits for a running prefill step; prefill, for a running decode step."""
    proc, release = start_child(tmp_path, child_role)
    try:
        gate = CoreShare("node-a", waiter_role, max_wait_s=60, directory=tmp_path)
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (gate.before_step(), done.set()), daemon=True)
        waiter.start()
        assert not done.wait(0.3)  # the other step is still running
        release.set()  # it ends
        assert done.wait(60)
        assert gate.num_waits == 1 and gate.wait_s > 0
        gate.after_step()
        gate.before_step()  # no step running: no wait
        assert gate.num_waits == 1
        gate.close()
    finally:
        proc.kill()
        proc.join(10)


def test_decode_marks_its_step_only_once_no_prefill_step_runs(tmp_path, prefill_child):
    proc, release = prefill_child
    decode = CoreShare("node-a", "decode", max_wait_s=60, directory=tmp_path)
    watcher = CoreShare("node-a", "prefill", max_wait_s=60, directory=tmp_path)  # sees decode's word
    watcher.before_step()
    waiter = threading.Thread(target=decode.before_step, daemon=True)
    waiter.start()
    time.sleep(0.2)
    watcher.after_step()
    assert not watcher.busy()  # decode is waiting, its word not set
    release.set()
    waiter.join(60)
    assert watcher.busy()  # now it steps
    decode.after_step()
    assert not watcher.busy()
    decode.close()
    watcher.close()


def test_the_wait_ends_at_max_wait_s_while_the_other_stays_busy(tmp_path, prefill_child):
    gate = CoreShare("node-a", "decode", max_wait_s=0.05, directory=tmp_path)
    gate.before_step()
    assert gate.num_waits == 1 and gate.wait_s >= 0.05
    gate.close()


def test_a_dead_engines_word_is_removed_and_not_waited_for(tmp_path, prefill_child):
    proc, release = prefill_child
    os.kill(proc.pid, signal.SIGKILL)  # dies mid-step: its word says busy
    proc.join(10)
    assert len(list(tmp_path.glob(core_share.PREFIX + "prefill-*"))) == 1
    gate = CoreShare("node-a", "decode", max_wait_s=60, directory=tmp_path)
    gate.before_step()
    assert gate.num_waits == 0 and not list(tmp_path.glob(core_share.PREFIX + "prefill-*"))
    gate.close()
    assert not list(tmp_path.glob(core_share.PREFIX + "*"))


def test_other_nodes_and_hung_steps_are_not_waited_for(tmp_path, prefill_child):
    gate = CoreShare("node-b", "decode", max_wait_s=60, directory=tmp_path)
    gate.before_step()
    assert gate.num_waits == 0  # node-a's prefill shares no core with node-b
    gate.after_step()
    hung = CoreShare("node-b", "prefill", max_wait_s=60, directory=tmp_path)
    struct.pack_into("q", hung._word, 0, time.monotonic_ns() - int((core_share.STALE_S + 1) * 1e9))  # began too long ago
    gate._scanned = float("-inf")
    gate.before_step()
    assert gate.num_waits == 0
    hung.close()
    gate.close()
    assert not list(tmp_path.glob(core_share.PREFIX + "*node*b*"))


def test_bad_roles_and_waits_are_refused(tmp_path):
    for role, wait in (("router", 1.0), ("decode", 0), ("prefill", -1)):
        with pytest.raises(ValueError, match="role must be one of"):
            CoreShare("n", role, wait, tmp_path)


@pytest.mark.parametrize("value", [-0.1, 2.5, True, "0.1"])
def test_yield_to_prefill_s_is_checked(value):
    with pytest.raises(ConfigError, match="decode.yield_to_prefill_s"):
        ClusterConfig.from_dict({"decode": {"yield_to_prefill_s": value}})
    assert ClusterConfig.from_dict({"decode": {"yield_to_prefill_s": 0.2}}).decode.yield_to_prefill_s == 0.2


def test_workers_taking_turns_hand_off_exactly_and_count_their_waits(tmp_path, monkeypatch, real_model_dir):
    """A prefill and a decode worker of one node (one process here), each on 2 threads,
    taking turns: a long prompt prefilled once another request is decoding (80 tokens, 8 a
    message). Every id equals HF's; decode waited for a prefill step at least once; both
    words are gone once the workers close; every block and lease is free."""
    monkeypatch.setattr(core_share, "signal_dir", lambda: tmp_path)
    cfg = {"model": {"path": "smollm2", "dtype": "float32", "max_model_len": 1024},
           "prefill": {"kv_cache_tokens": 2048, "block_size": 16, "num_threads": 2},
           "decode": {"kv_cache_tokens": 2048, "block_size": 16, "num_threads": 2, "yield_to_prefill_s": 2.0},
           "kv_transfer": {"backend": "grpc", "bind_host": "127.0.0.1", "timeout_s": 5.0}}
    prefill, decode = PrefillServer(cfg), DecodeServer(cfg)
    model, tokenizer = load_model(real_model_dir, "float32"), load_tokenizer(real_model_dir)
    long_text = " ".join(f"Item {i} of the list is a colour." for i in range(60))  # ~600 tokens: a prefill step of many decode steps
    prompts = [tokenizer(text, return_tensors=None)["input_ids"] for text in ("The three primary colours are", long_text)]
    wants = [reference_generate(model, p, n, ignore_eos=True) for p, n in zip(prompts, (80, 8))]

    async def one(i: int, wait: asyncio.Event | None, decoding: asyncio.Event | None) -> list[int]:
        if wait is not None:
            await wait.wait()  # the other request is decoding now
        params = SamplingParams(max_tokens=len(wants[i]), ignore_eos=True)
        first = await prefill.prefill(PrefillRequest(f"r{i}", prompts[i], params))
        tokens = [first.first_token]
        async for chunk in decode.generate(WithKV(f"r{i}", prompts[i], params, first.first_token, first.kv)):
            tokens.extend(chunk.token_ids)
            if decoding is not None:
                decoding.set()
        return tokens

    async def both():
        decoding = asyncio.Event()
        return await asyncio.gather(one(0, None, decoding), one(1, decoding, None))

    try:
        assert asyncio.run(both()) == wants
        d = asyncio.run(decode.stats())
        assert d["num_prefill_yields"] >= 1 and d["prefill_yield_s"] > 0
        assert {"num_decode_waits", "decode_wait_s"} <= set(asyncio.run(prefill.stats()))
        for _ in range(300):
            p, d = asyncio.run(prefill.stats()), asyncio.run(decode.stats())
            if p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]:
                break
            time.sleep(0.02)
        assert p["num_held"] == 0 and p["num_free_blocks"] == p["num_blocks"] and d["num_free_blocks"] == d["num_blocks"]
    finally:
        prefill.loop.close(wait_s=30)
        decode.loop.close(wait_s=30)
    assert not list(tmp_path.glob(core_share.PREFIX + "*"))
    prefill.__del__()
    decode.__del__()
