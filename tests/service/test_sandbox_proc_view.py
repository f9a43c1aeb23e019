"""What a session sees of the host through /proc (issue 17, item 9), in every isolation layer:
real commands in real sessions, compared with what the host (this test process) sees. Where a
layer cannot hide something, the test asserts that it is visible, as README's Security section
says ("Not promised")."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from shellrl.clients.sandbox import SandboxClient

LAYERS = ["bubblewrap", "unshare", "fallback"]
MARKER = "31337.5"  # a `sleep` argument no other process has


@pytest.fixture(params=LAYERS)
def layer(request):
    return request.param


@pytest.fixture
async def client(sandbox_services, layer):
    async with SandboxClient(sandbox_services.get(layer).url, timeout_s=30) as c:
        yield c


async def run(client, sid: str, command: str) -> str:
    result = await client.exec(sid, command, timeout_s=20)
    assert result.exit_code == 0, result
    return result.stdout


async def test_a_session_sees_only_its_own_processes(client, layer, sandbox_services):
    other = (await client.create_session())["session_id"]
    await client.exec(other, f"sleep {MARKER} &")
    sid = (await client.create_session())["session_id"]
    uid = (await client.session_info(sid))["uid"]
    service_pid = sandbox_services.get(layer).proc.pid
    listing = await run(client, sid, "ps -eo uid=,args= | cat")
    assert MARKER not in listing and "pytest" not in listing and "services.sandbox" not in listing
    assert {int(line.split()[0]) for line in listing.splitlines()} == {uid}, listing
    # host command lines and environments, by pid: the test's own, the service's
    for pid in (os.getpid(), service_pid):
        seen = await run(client, sid, f"cat /proc/{pid}/cmdline /proc/{pid}/environ 2>&1; true")
        assert "pytest" not in seen and "services.sandbox" not in seen and "SHELLRL_" not in seen
    ready = await client.ready()
    assert ready["proc_view"]["processes"] == ("own_uid" if layer == "fallback" else "session")
    for s in (sid, other):
        await client.delete(s)


async def test_host_kernel_details_read_as_empty(client, layer):
    sid = (await client.create_session())["session_id"]
    ready = await client.ready()
    masked = ready["proc_view"]["masked"]
    assert "/proc/cmdline" in masked and "/proc/kallsyms" in masked
    assert Path("/proc/cmdline").read_text().strip()  # the host's is not empty
    for path in masked:
        listing = "ls -A" if Path(path).is_dir() else "cat"
        assert await run(client, sid, f"{listing} {path}") == "", path
    await client.delete(sid)


async def test_meminfo_and_loadavg_are_the_sessions_where_the_layer_has_its_own_proc(client, layer):
    sid = (await client.create_session(limits={"memory_bytes": 300 << 20}))["session_id"]
    meminfo = await run(client, sid, "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo")
    loadavg = await run(client, sid, "cat /proc/loadavg")
    free = await run(client, sid, "free -b | awk '/^Mem:/ {print $2}'")
    host_total = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)
    if layer == "fallback":  # the host's /proc (README: not promised)
        assert f"MemTotal:       {host_total} kB" in meminfo
    else:
        kib = (300 << 20) // 1024
        assert meminfo == f"MemTotal:       {kib:>8} kB\nMemAvailable:   {kib:>8} kB\n"
        assert loadavg == "0.00 0.00 0.00 1/1 1\n" and free == f"{300 << 20}\n"
    await client.delete(sid)


async def test_mountinfo_names_no_session_id_and_bubblewrap_no_host_path(
    client, layer, sandbox_services
):
    session = await client.create_session(setup="echo hi > a.txt")
    sid = session["session_id"]
    mountinfo = await run(client, sid, "cat /proc/self/mountinfo; pwd")
    assert sid not in mountinfo and sid not in session["workspace"]
    workspace_root = str(sandbox_services.workspace_base)
    if layer == "bubblewrap":
        assert workspace_root not in mountinfo
        assert "/tmp/" not in mountinfo and "shellrl-sandbox-test" not in mountinfo
    else:  # unshare and fallback run at the host path, in the host's file tree
        assert workspace_root in mountinfo
    await client.delete(sid)
