"""`fresh_state` execs and `POST /v1/sessions/{id}/kill` against real sandbox services, in the
bubblewrap layer (session and per-command exec modes) and the process-group fallback: what the
verifier relies on so that an agent cannot shape how a later check command runs."""

from __future__ import annotations

import asyncio
import shlex

import pytest

from shellrl.clients.sandbox import SandboxClient, SandboxNotFound
from tests.helpers.waiting import wait_until_async

CONFIGS = [("bubblewrap", {}), ("bubblewrap", {"exec_mode": "per_command"}), ("fallback", {})]
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STATE_DIR = 'st=$(dirname "$HOME")/state; [ -d /run/shellrl/state ] && st=/run/shellrl/state'
FORGED_STATE = (  # what an agent can leave in the saved shell state: shadowed builtins, an imported function...
    "exec() { echo forged-exec; }\n"
    "cd() { echo forged-cd; }\n"
    "cat() { echo forged-func; }\n"
    "export -f cat\n"
    "shopt -s expand_aliases; alias ls='echo forged-alias'\n"
    'export PATH="$HOME/bin:$PATH" BASH_ENV="$HOME/rc" GREETING=forged\n'
)


@pytest.fixture(params=CONFIGS, ids=["bubblewrap", "bubblewrap-per_command", "fallback"])
async def client(request, sandbox_services):
    layer, settings = request.param
    async with SandboxClient(sandbox_services.get(layer, **settings).url, timeout_s=30) as c:
        yield c


async def test_a_forged_shell_state_does_not_reach_a_fresh_state_exec(client):
    # the task env itself points PATH and BASH_ENV into the workspace: fresh_state ignores both
    session = await client.create_session(
        setup="echo real > a.txt; mkdir sub",
        env={
            "GREETING": "hi",
            "PATH": "<workspace>/bin:/usr/bin:/bin",
            "BASH_ENV": "<workspace>/rc",
        },
    )
    sid, ws = session["session_id"], session["workspace"]
    agent = (
        (
            "mkdir -p bin && printf '#!/bin/sh\\necho fake-cat\\n' > bin/cat && chmod +x bin/cat"
            " && echo 'echo from-bash-env' > rc && echo 'echo from-bashrc' > .bashrc"
        ),
        f"{STATE_DIR}; trap - EXIT; printf %s {shlex.quote(FORGED_STATE)} > $st/env; printf /tmp > $st/cwd",
    )
    for command in agent:
        assert (await client.exec(sid, command)).exit_code == 0
    probe = (
        'cat a.txt; pwd; echo "$GREETING|$PATH|${BASH_ENV-unset}|${ENV-unset}"; type -t exec cd cat; '
        "ls a.txt; env | grep -c BASH_FUNC"
    )
    fresh = await client.exec(sid, probe, fresh_state=True)
    assert (
        fresh.stdout
        == f"real\n{ws}\nhi|{SANDBOX_PATH}|unset|unset\nbuiltin\nbuiltin\nfile\na.txt\n0\n"
    ), fresh
    assert fresh.stderr == ""
    # the fresh exec did not rewrite the saved state: the agent's next command runs the forgery
    forged = await client.exec(sid, "cat a.txt; echo $GREETING")
    assert "forged" in forged.stdout and "real" not in forged.stdout
    await client.delete(sid)


async def test_fresh_state_exec_keeps_the_agents_own_cwd_and_variables_for_later_commands(client):
    session = await client.create_session(setup="mkdir sub")
    sid, ws = session["session_id"], session["workspace"]
    await client.exec(sid, "cd sub && export COLOR=blue")
    assert (
        await client.exec(sid, 'pwd; echo "${COLOR-unset}"', fresh_state=True)
    ).stdout == f"{ws}\nunset\n"
    assert (await client.exec(sid, 'pwd; echo "$COLOR"')).stdout == f"{ws}/sub\nblue\n"
    result = await client.exec(sid, "sleep 30", timeout_s=1, fresh_state=True)
    assert (result.timed_out, result.exit_code) == (True, 124)
    await client.delete(sid)


async def test_kill_stops_background_and_setsid_processes_and_keeps_the_session(client):
    if (await client.ready())["exec_mode"] == "per_command":
        pytest.skip("per-command mode: background processes end with their command's sandbox")
    session = await client.create_session()
    sid = session["session_id"]
    ticker = "while :; do date +%s%N > {}; sleep 0.05; done"
    await client.exec(
        sid,
        f"mkdir sub && cd sub && ({ticker.format('tick')} &) ;"
        f" setsid sh -c '{ticker.format('tick2')}' >/dev/null 2>&1 & echo started",
    )
    before = await wait_until_async(
        lambda: _content(client, sid, "sub/tick"), 10, "the ticker's first write"
    )
    await wait_until_async(  # the ticker runs
        lambda: _changed(client, sid, "sub/tick", before), 10, "the ticker's next write"
    )
    await wait_until_async(lambda: _content(client, sid, "sub/tick2"), 10, "the setsid ticker")
    reply = await client.kill_processes(sid)
    assert reply["killed"] is True and reply["session_id"] == sid
    stopped = await client.read_file(sid, "sub/tick")
    assert stopped == await _later(client, sid, "sub/tick") and await client.read_file(
        sid, "sub/tick2"
    ) == await _later(client, sid, "sub/tick2")
    after = await client.exec(
        sid, "pwd; ls"
    )  # workspace and saved shell state kept, session usable
    assert after.stdout == f"{session['workspace']}/sub\ntick\ntick2\n" and after.exit_code == 0
    await client.delete(sid)
    with pytest.raises(SandboxNotFound):
        await client.kill_processes(sid)


async def _content(client, sid: str, path: str) -> bytes:
    """The file's content; empty while it does not exist yet (or between truncate and write)."""
    try:
        return await client.read_file(sid, path)
    except SandboxNotFound:
        return b""


async def _changed(client, sid: str, path: str, before: bytes) -> bool:
    return (await _content(client, sid, path)) not in (b"", before)


async def _later(client, sid: str, path: str) -> bytes:
    await asyncio.sleep(0.3)
    return await client.read_file(sid, path)
