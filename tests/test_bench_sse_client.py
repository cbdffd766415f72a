"""bench.online.sse_client against scripted raw-socket servers: HTTP framing, event timing, reuse.

Each test's server writes its response bytes in pieces with pauses between them, so the client
must reassemble what crosses read boundaries and time each event by the read that completed it.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.online.sse_client import HTTPProtocolError, StreamingClient

PAUSE_S = 0.12  # between the pieces of a response: well above the loop's scheduling noise


def _chunked(*pieces: bytes) -> list[bytes]:
    """Each piece as one HTTP chunk, then the last chunk."""
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class ScriptedServer:
    """Answers each request on a connection with the next scripted response: a list of byte
    pieces written with PAUSE_S between them (None: close the connection there)."""

    def __init__(self, responses: list[list[bytes | None]]) -> None:
        self.responses = list(responses)
        self.connections = 0
        self.requests: list[bytes] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.responses:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                for i, piece in enumerate(self.responses.pop(0)):
                    if piece is None:
                        writer.close()
                        return
                    if i:
                        await asyncio.sleep(PAUSE_S)
                    writer.write(piece)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self._server.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_events_are_split_across_reads_and_timed_by_the_read_that_completed_them():
    # Event 1 and half of event 2 in one chunk, the rest of event 2 and event 3 later; a comment
    # line, CRLF line ends and a data field over two lines along the way.
    body = _chunked(b'data: {"n": 1}\n\ndata: {"n"', b': 2}\n\n: keep-alive\n\n', b'data: a\r\ndata: b\r\n\r\ndata: [DONE]\n\n')
    pieces = [SSE_HEAD + body[0], body[1], body[2] + body[3]]

    async def main():
        async with ScriptedServer([pieces]) as url, StreamingClient(url) as client:
            loop = asyncio.get_running_loop()
            start = loop.time()
            response = await client.request("POST", "/v1/completions", {"prompt": "x"})
            return start, response

    start, response = run(main())
    assert response.status == 200
    assert [data for _, data in response.events] == [b'{"n": 1}', b'{"n": 2}', b"a\nb", b"[DONE]"]
    (t1, _), (t2, _), (t3, _), (t4, _) = response.events
    assert t2 - t1 >= PAUSE_S * 0.8  # event 2 completed with the second read, not the first
    assert t3 - t2 >= PAUSE_S * 0.8 and t4 == t3  # events 3 and 4 arrived in one read


def test_chunk_framing_split_anywhere_gives_the_same_events():
    body = b"".join(_chunked(b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n'))
    whole = SSE_HEAD + body
    for cut in (len(SSE_HEAD) - 3, len(SSE_HEAD) + 1, len(SSE_HEAD) + 5, len(whole) - 4, len(whole) - 1):
        async def main(cut=cut):
            async with ScriptedServer([[whole[:cut], whole[cut:]]]) as url, StreamingClient(url) as client:
                return await client.request("GET", "/stream")

        assert [d for _, d in run(main()).events] == [b'{"a": 1}', b'{"b": 2}'], cut


def test_json_and_error_bodies_by_content_length_and_request_shape():
    models = json.dumps({"data": [{"id": "m"}]}).encode()
    error = b'{"error": {"message": "bad"}}'
    responses = [
        [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(models) + models],
        [b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
         % (len(error), error[:10]), error[10:]],
    ]

    async def main():
        server = ScriptedServer(responses)
        async with server as url, StreamingClient(url + "/prefix/") as client:
            models_json = await client.get_json("/v1/models")
            failed = await client.request("POST", "/v1/completions", {"prompt": "p"})
            return server, models_json, failed

    server, models_json, failed = run(main())
    assert models_json == {"data": [{"id": "m"}]}
    assert failed.status == 400 and failed.body == error and failed.events == []
    assert server.requests[0].startswith(b"GET /prefix/v1/models HTTP/1.1\r\n")
    post = server.requests[1]
    assert post.startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n")
    assert json.loads(post.split(b"\r\n\r\n", 1)[1]) == {"prompt": "p"}
    assert server.connections == 1  # the second request reused the kept connection


def test_a_body_delimited_by_the_connections_end():
    head = b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"

    async def main():
        async with ScriptedServer([[head + b"data: 1\n\n", b"data: 2\n\n", None]]) as url, StreamingClient(url) as client:
            return await client.request("GET", "/s")

    assert [d for _, d in run(main()).events] == [b"1", b"2"]


def test_a_connection_closed_mid_response_is_an_error():
    async def main():
        async with ScriptedServer([[SSE_HEAD + _chunked(b"data: 1\n\n")[0], None]]) as url, StreamingClient(url) as client:
            await client.request("GET", "/s")

    with pytest.raises(HTTPProtocolError, match="mid-response"):
        run(main())


@pytest.mark.parametrize("script", [
    # The server closes the kept connection after the first response (its idle timeout) without
    # saying so: the client sees the close before it reuses the connection.
    [[OK, None], [OK]],
    # The server drops the kept connection as the second request arrives, before answering: the
    # request never reached it, so the client sends it again on a new connection.
    [[OK], [None], [OK]],
])
def test_a_kept_connection_the_server_closed_is_replaced_transparently(script):
    async def main():
        server = ScriptedServer(script)
        async with server as url, StreamingClient(url) as client:
            first = await client.get_json("/a")
            await asyncio.sleep(0.05)
            second = await client.get_json("/b")
            return server, first, second

    server, first, second = run(main())
    assert first == second == {} and server.connections == 2
    assert len(server.requests) == len(script)


def test_malformed_responses_and_timeouts():
    async def one(pieces, timeout_s=5.0):
        async with ScriptedServer([pieces]) as url, StreamingClient(url) as client:
            return await client.request("GET", "/s", timeout_s=timeout_s)

    with pytest.raises(HTTPProtocolError, match="status line"):
        run(one([b"SSH-2.0-OpenSSH\r\n\r\n"]))
    with pytest.raises(HTTPProtocolError, match="chunk size"):
        run(one([SSE_HEAD + b"zz\r\n"]))
    with pytest.raises(HTTPProtocolError, match="Content-Length"):
        run(one([b"HTTP/1.1 200 OK\r\ncontent-length: ten\r\n\r\n"]))
    with pytest.raises(TimeoutError):  # the head never ends
        run(one([b"HTTP/1.1 200 OK\r\n", b"x-slow: 1\r\n"], timeout_s=0.05))


def test_only_plain_http_urls():
    for url in ("https://example.com", "ftp://host", "127.0.0.1:8000"):
        with pytest.raises(ValueError, match="plain http"):
            StreamingClient(url)
