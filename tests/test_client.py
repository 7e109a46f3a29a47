"""The client SDK's retry rule against a real gRPC server on loopback that fails on purpose:
UNAVAILABLE before the first chunk is retried; after it, the error goes to the caller."""

import asyncio
from concurrent import futures

import grpc
import pytest

from pdserve.client import AsyncClient, Client
from pdserve.rpc import generate_pb2 as pb
from pdserve.rpc import generate_pb2_grpc as pb_grpc


class Flaky(pb_grpc.GeneratorServicer):
    def __init__(self, fail_first: int, break_after_first_chunk: bool = False):
        self.fail_first, self.break_after = fail_first, break_after_first_chunk
        self.calls = 0

    def Generate(self, request, context):
        self.calls += 1
        if self.calls <= self.fail_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[5], text="a", prompt_tokens=1, completion_tokens=1)
        if self.break_after:
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica died")
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[6], text="b", finish_reason="length",
                                  prompt_tokens=1, completion_tokens=2)


@pytest.fixture
def serve():
    servers = []

    def start(servicer):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_GeneratorServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(None)


def test_unavailable_before_the_first_chunk_is_retried(serve):
    servicer = Flaky(fail_first=2)
    with Client(serve(servicer), retries=3, backoff_s=0.01) as client:
        result = client.generate("hi", request_id="r1", max_tokens=2)
    assert servicer.calls == 3
    assert (result.token_ids, result.text, result.finish_reason, result.request_id) == ([5, 6], "ab", "length", "r1")


def test_retries_are_bounded(serve):
    servicer = Flaky(fail_first=10)
    with Client(serve(servicer), retries=2, backoff_s=0.01) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate("hi")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and servicer.calls == 3


def test_no_retry_once_output_has_started(serve):
    servicer = Flaky(fail_first=0, break_after_first_chunk=True)
    with Client(serve(servicer), retries=3, backoff_s=0.01) as client:
        chunks = []
        with pytest.raises(grpc.RpcError):
            for chunk in client.stream("hi"):
                chunks.append(chunk)
    assert servicer.calls == 1 and [c.text for c in chunks] == ["a"]


def test_async_client_retries_and_types_its_results(serve):
    servicer = Flaky(fail_first=1)

    async def main():
        async with AsyncClient(serve(servicer), backoff_s=0.01) as client:
            chunks = [c async for c in client.stream("hi")]
            return chunks, await client.generate("hi")

    chunks, result = asyncio.run(main())
    assert [c.finish_reason for c in chunks] == [None, "length"] and chunks[1].completion_tokens == 2
    assert result.token_ids == [5, 6] and servicer.calls == 3


def test_unknown_sampling_parameter_is_refused_client_side():
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        Client("127.0.0.1:1").stream("hi", temprature=0.5)


class Slow(pb_grpc.GeneratorServicer):
    def Generate(self, request, context):
        for i in range(50):
            yield pb.GenerateResponse(token_ids=[i], text="x")
            if not context.is_active():
                return
            import time

            time.sleep(0.1)


def test_cancel_ends_the_stream_without_an_error(serve):
    address = serve(Slow())
    with Client(address) as client:
        stream = client.stream("hi")
        got = []
        for chunk in stream:
            got.append(chunk)
            if len(got) == 2:
                stream.cancel()
    assert len(got) == 2

    async def main():
        async with AsyncClient(address) as client:
            stream, got = client.stream("hi"), []
            async for chunk in stream:
                got.append(chunk)
                if len(got) == 2:
                    stream.cancel()
            return got

    assert len(asyncio.run(main())) == 2
