"""`port_is_free`: a listener makes a port busy; connections in TIME_WAIT (left by a stack that was
just stopped) do not, because uvicorn and redis-server bind with SO_REUSEADDR."""

import socket

from cli.stack_config import port_is_free


def _listener() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_listening_port_is_busy():
    with _listener() as s:
        assert not port_is_free(s.getsockname()[1])


def test_time_wait_connections_leave_the_port_free():
    server = _listener()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end of the connection enters TIME_WAIT
    client.close()
    server.close()
    plain = socket.socket()  # the check before the fix: bind without SO_REUSEADDR fails here
    try:
        plain.bind(("127.0.0.1", port))
        time_wait_blocks_plain_bind = False
    except OSError:
        time_wait_blocks_plain_bind = True
    finally:
        plain.close()
    assert time_wait_blocks_plain_bind  # the situation exists ...
    assert port_is_free(port)  # ... and is not reported as busy


def test_a_busy_port_names_itself_and_the_way_to_run_a_second_stack(tmp_path):
    """A new user met "ports in use ... try `shellrl down`" when they wanted a second stack: the
    message now also names --port-offset (checked after the launcher's 20 s wait for a stack
    that is still stopping)."""
    import pytest

    from cli.launcher import Stack
    from cli.stack_config import DEFAULT_PORTS, StackConfig
    from cli.stack_failure import StackError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        config = StackConfig(
            state_dir=tmp_path, ports={**DEFAULT_PORTS, "redis": port}, services=()
        )
        with pytest.raises(StackError, match=rf"ports in use: redis:{port} .*--port-offset N"):
            Stack(config).start()
