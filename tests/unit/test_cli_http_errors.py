"""`cli.errors.http_errors`: what `shellrl eval` and `shellrl run --attach` print when the stack
answers with an error status or does not answer at all (one CliError line, no traceback)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from cli.errors import CliError, http_errors
from tests.helpers.redis_server import free_port


class _Refusing(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"error": "' + b"x" * 400 + b'"}'
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def refusing_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_error_status_names_the_url_the_status_and_the_start_of_the_body(refusing_url):
    with pytest.raises(CliError) as caught, http_errors("cannot reach the gateway"):
        httpx.get(f"{refusing_url}/v1/runs", timeout=5).raise_for_status()
    message = str(caught.value)
    assert message.startswith(f"{refusing_url}/v1/runs answered 503: ")
    assert len(message.split(": ", 1)[1]) == 300 and caught.value.__cause__ is None


def test_no_answer_names_what_could_not_be_reached():
    url = f"http://127.0.0.1:{free_port()}"
    with (
        pytest.raises(CliError, match="^cannot reach the gateway: "),
        http_errors("cannot reach the gateway"),
    ):
        httpx.get(url, timeout=5)


def test_other_errors_pass_through():
    with pytest.raises(KeyError), http_errors("cannot reach the gateway"):
        raise KeyError("not an HTTP error")
