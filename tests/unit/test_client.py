"""The client SDK's retry rule against a real gRPC server on loopback that fails on purpose:
UNAVAILABLE and RESOURCE_EXHAUSTED before the first chunk are retried (after the server's
retry-after hint); after it, the error goes to the caller. The API key travels as metadata."""

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


class Busy(pb_grpc.GeneratorServicer):
    """RESOURCE_EXHAUSTED with a retry-after hint for the first ``busy_for`` calls; records
    each call's time and authorization metadata."""

    def __init__(self, busy_for: int, hint_s: str = "0.2"):
        self.busy_for, self.hint_s, self.calls, self.auth = busy_for, hint_s, [], []

    def Generate(self, request, context):
        import time

        self.calls.append(time.monotonic())
        self.auth.append(dict(context.invocation_metadata()).get("authorization"))
        if len(self.calls) <= self.busy_for:
            context.set_trailing_metadata([("retry-after", self.hint_s)])
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "server busy")
        yield pb.GenerateResponse(token_ids=[7], text="z", finish_reason="length", prompt_tokens=1, completion_tokens=1)


def test_resource_exhausted_is_retried_after_the_servers_hint_with_the_api_key(serve, monkeypatch):
    import pdserve.client as client_module

    servicer, waits, sleep = Busy(busy_for=2), [], client_module.time.sleep
    monkeypatch.setattr(client_module.time, "sleep", lambda s: (waits.append(s), sleep(s))[1])
    with Client(serve(servicer), retries=3, backoff_s=0.001, api_key="s3cret") as client:
        assert client.generate("hi").token_ids == [7]
    assert len(servicer.calls) == 3 and waits == [float(servicer.hint_s)] * 2, waits  # waited the hint, not the 1 ms backoff
    assert servicer.auth == ["Bearer s3cret"] * 3


def test_resource_exhausted_beyond_the_retries_reaches_the_caller(serve):
    servicer = Busy(busy_for=10, hint_s="0.01")
    with Client(serve(servicer), retries=1) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate("hi")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and len(servicer.calls) == 2 and servicer.auth == [None, None]


def test_unknown_sampling_parameter_is_refused_client_side():
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        Client("127.0.0.1:1").stream("hi", temprature=0.5)


def test_a_mistyped_sampling_parameter_is_named_and_one_stop_string_stays_whole():
    from pdserve.client import build_request

    with pytest.raises(TypeError, match="temperature='hot'"):
        build_request("hi", temperature="hot")
    with pytest.raises(ValueError, match="seed=9223372036854775808"):  # past int64: out of range, not a type error
        build_request("hi", seed=2**63)
    with pytest.raises(ValueError, match=r"top_p=1e-50: out of the float32 field's range \(it would arrive as 0.0\)"):
        build_request("hi", top_p=1e-50)
    with pytest.raises(ValueError, match="temperature=1e.39: out of the float32 field's range"):
        build_request("hi", temperature=1e39)
    assert build_request("hi", temperature=0.0, top_p=1e-30).params.temperature == 0.0
    assert list(build_request("hi", stop="abc").params.stop) == ["abc"]
    assert list(build_request("hi", stop=["a", "bc"]).params.stop) == ["a", "bc"]
    sent = build_request("hi", logit_bias={5: -100.0, 7: 2.5}, min_p=0.25).params
    assert dict(sent.logit_bias) == {5: -100.0, 7: 2.5} and sent.min_p == 0.25
    with pytest.raises(TypeError, match="logit_bias="):  # OpenAI's string keys are for HTTP; the SDK takes ids
        build_request("hi", logit_bias={"5": 1.0})


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


def test_the_retry_hint_is_read_from_the_message_when_metadata_is_dropped():
    from pdserve.client import server_retry_after_s

    class Error(grpc.RpcError):
        def trailing_metadata(self):
            return ()

        def details(self):
            return "server busy: 4 requests in flight (router.max_in_flight); retry after 0.5 s"

    assert server_retry_after_s(Error()) == 0.5


class Endless(pb_grpc.GeneratorServicer):
    """Streams a token every 10 ms, max_tokens of them; ``ended`` is set when the call ends on the server."""

    def __init__(self):
        import threading

        self.ended, self.calls = threading.Event(), 0

    def Generate(self, request, context):
        import time

        self.calls += 1
        context.add_callback(self.ended.set)
        for i in range(request.params.max_tokens or 1000):
            if not context.is_active():
                return
            yield pb.GenerateResponse(token_ids=[i], text="x", prompt_tokens=1, completion_tokens=i + 1)
            time.sleep(0.01)

    def Health(self, request, context):
        return pb.HealthResponse()


def test_leaving_the_loop_of_a_held_stream_ends_the_call_and_a_stream_runs_once(serve):
    servicer = Endless()
    with Client(serve(servicer)) as client:
        stream = client.stream("hi", max_tokens=1000)  # held: its call must not outlive the loop
        for _ in stream:
            break
        assert servicer.ended.wait(5), "the server kept generating for a loop that had ended"
        with pytest.raises(RuntimeError, match="already iterated"):
            next(iter(stream))
    assert servicer.calls == 1


def test_leaving_the_loop_of_a_held_async_stream_ends_the_call(serve):
    servicer = Endless()
    endpoint = serve(servicer)

    async def run():
        async with AsyncClient(endpoint) as client:
            stream = client.stream("hi", max_tokens=1000)
            async for _ in stream:
                break
            for _ in range(500):  # the event loop finalizes the abandoned iterator
                if servicer.ended.is_set():
                    return True
                await asyncio.sleep(0.01)
            return False

    assert asyncio.run(run()), "the server kept generating for a loop that had ended"


def test_the_cli_refuses_out_of_range_values_in_one_line_and_says_when_its_model_flag_is_not_applied(serve):
    from typer.testing import CliRunner

    from pdserve_app.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["generate", "--endpoint", "127.0.0.1:1", "--max-tokens", "99999999999", "hi"])
    assert out.exit_code == 2 and "error: sampling parameter max_tokens=99999999999" in out.output, out.output
    endpoint = serve(Endless())
    out = runner.invoke(app, ["generate", "--endpoint", endpoint, "--model", "other", "--max-tokens", "3", "hi"])
    assert "note: pdserve already answers at" in out.output and "--config/--model are not applied" in out.output, out.output


def test_structured_output_arguments_fill_the_requests_oneof():
    from pdserve.client import build_request

    req = build_request("hi", json_schema={"type": "object"})
    assert req.WhichOneof("structured_output") == "json_schema" and req.json_schema == '{"type": "object"}'
    assert build_request("hi", json_schema='{"type": "string"}').json_schema == '{"type": "string"}'
    assert build_request("hi", choice=["a", "b"]).choice.choices == ["a", "b"]
    assert build_request("hi", json_object=True).WhichOneof("structured_output") == "json_object"
    assert build_request("hi", regex="a+").regex == "a+" and build_request("hi", grammar='root ::= "a"').grammar == 'root ::= "a"'
    assert build_request("hi", json_object=False).WhichOneof("structured_output") is None
    with pytest.raises(ValueError, match="set at most one of .*got regex, choice"):
        build_request("hi", regex="a", choice=["b"])
    with pytest.raises(TypeError, match="choice must be a list of strings"):
        build_request("hi", choice="ab")
