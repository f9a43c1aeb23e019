"""What a session can do to its cgroups (issue 32, item 4), in every isolation layer and in
per-command mode: the probe of H01/H27 (mountinfo names no cgroup file; writing a pid into any
cgroup.procs the session can see fails), and that commands still join the session's groups while
the runner stays outside them. Commands join through fds of the cgroup.procs files the service
opens as root (services/sandbox/isolation/launch.py). Skipped where the service has no cgroups."""

from __future__ import annotations

import pytest

from shellrl.clients.sandbox import SandboxClient

CONFIGURATIONS = [
    ("bubblewrap", {}),
    ("bubblewrap", {"exec_mode": "per_command"}),
    ("unshare", {}),
    ("fallback", {}),
]
PROBE = r"""
grep -c 'cgroup\.procs\|/run/shellrl/cgroup' /proc/self/mountinfo
ls /run/shellrl/cgroup 2>/dev/null | wc -l
for group in $(cut -d: -f3 /proc/self/cgroup | sort -u); do
  for f in /sys/fs/cgroup/*"$group"/cgroup.procs /run/shellrl/cgroup/*; do
    [ -e "$f" ] && { (echo 1 > "$f") 2>/dev/null && echo "WROTE $f"; (echo $$ > "$f") 2>/dev/null && echo "WROTE $f"; }
  done
done
find /sys/fs/cgroup /run/shellrl -name cgroup.procs -writable 2>/dev/null | head -3
echo end
"""


@pytest.fixture(params=CONFIGURATIONS, ids=lambda c: "-".join([c[0], *c[1].values()]))
async def session(request, sandbox_services):
    layer, settings = request.param
    service = sandbox_services.get(layer, **settings)
    async with SandboxClient(service.url, timeout_s=30) as client:
        ready = await client.ready()
        if not ready.get("cgroups"):
            pytest.skip("this instance has no cgroups")
        created = await client.create_session()
        yield client, created["session_id"], layer, settings
        await client.delete(created["session_id"])


async def test_no_cgroup_file_is_named_in_mountinfo_or_writable_from_a_session(session):
    client, sid, layer, settings = session
    result = await client.exec(sid, PROBE, timeout_s=30)
    assert result.stdout == "0\n0\nend\n", result
    uid = (await client.session_info(sid))["uid"]
    own = await client.exec(sid, "grep -E '^[0-9]+:pids:' /proc/self/cgroup", timeout_s=20)
    assert own.stdout.rstrip().endswith(f"/u{uid}"), own  # the command joined its group
    if layer != "fallback" and "exec_mode" not in settings:  # pid 1 is the runner
        runner = await client.exec(sid, "grep -E '^[0-9]+:pids:' /proc/1/cgroup", timeout_s=20)
        assert not runner.stdout.rstrip().endswith(f"/u{uid}"), runner  # and it stays outside
    again = await client.exec(sid, "echo still here", timeout_s=20)
    assert again.stdout == "still here\n" and again.exit_code == 0
