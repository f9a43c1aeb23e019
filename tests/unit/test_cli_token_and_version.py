"""CLI consistency (issue 34 item 5): `shellrl --version`; `show`, `submit` and `eval --url` take
`--state-dir` and send that stack's token; a 401 names where the CLI reads the token. Against a real HTTP
server on a free port that refuses every request and records the Authorization header."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli.main import main
from shellrl.service.auth import new_token


class Refusing(BaseHTTPRequestHandler):
    seen: list[str] = []

    def _refuse(self) -> None:
        Refusing.seen.append(self.headers.get("Authorization", ""))
        body = b'{"error": {"code": "unauthorized", "message": "bad token"}}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _refuse

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def refusing_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Refusing.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("shellrl 0.1")


@pytest.mark.parametrize("command", ["show", "submit", "eval"])
def test_a_401_names_where_the_token_is_read_and_state_dir_picks_the_stack(
    command, refusing_url, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("SHELLRL_API_TOKEN", raising=False)
    monkeypatch.delenv("SHELLRL_API_TOKEN_FILE", raising=False)
    token = new_token()
    (tmp_path / "api_token").write_text(token + "\n")
    if command == "show":
        argv = ["show", "some-id"]
    elif command == "eval":
        argv = ["eval", "--sets", "seeds"]
    else:
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text('{"task_id": "t1"}\n')
        argv = ["submit", str(tasks)]
    status = main([*argv, "--url", refusing_url, "--state-dir", str(tmp_path)])
    assert status == (1 if command == "submit" else 2)
    err = capsys.readouterr().err
    assert "refused the token (401)" in err, err
    if command != "eval":  # eval's 401 names the sources of any stack (cli/errors.py)
        assert str(tmp_path / "api_token") in err, err
    assert Refusing.seen and set(Refusing.seen) == {f"Bearer {token}"}
