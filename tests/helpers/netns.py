"""Run a test's scenario where nothing it sends can leave the machine: a child process in its own
network, mount and pid namespaces (`unshare --net --mount --pid --fork --kill-child`) with only
loopback up. Addresses the scenario aims at (100.64.0.1, a public one ...) are added to `lo` in
that namespace, so a connection that should not happen lands on a listener of the scenario
instead of a route; `/etc/hosts` is bound over (in the child's mount namespace only) by the
scenario's names, so `getaddrinfo` resolves them the real way. The child checks that `lo` is its
only interface before the scenario runs, and everything it started dies with it (pid namespace).

    result = run_isolated("tests.service.test_x:scenario", {"k": 1}, addresses=["100.64.0.1"],
                          hosts={"cgnat.test": "100.64.0.1"})

The scenario is `def scenario(spec: dict) -> dict` (or async); its result comes back as JSON.
Needs root (skips otherwise).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.owned_processes import run_owned

ROOT = Path(__file__).resolve().parents[2]
RESULT_MARK = "NETNS-RESULT "


def run_isolated(
    target: str,
    spec: dict,
    *,
    addresses: list[str] = (),
    hosts: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> dict:
    """`target` ("module:function") run on `spec` in an isolated child; its returned dict."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("an isolated network namespace needs root, unshare(1) and ip(8)")
    with tempfile.TemporaryDirectory(prefix="shellrl-netns-") as tmp:
        hosts_file = Path(tmp) / "hosts"
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{address} {name}" for name, address in (hosts or {}).items()]
        hosts_file.write_text("\n".join(lines) + "\n")
        steps = ["ip link set lo up"]
        steps += [f"ip addr add {shlex.quote(a)} dev lo" for a in addresses]
        steps.append(f"mount --bind {shlex.quote(str(hosts_file))} /etc/hosts")
        steps.append(f"exec {shlex.quote(sys.executable)} -m tests.helpers.netns {target}")
        argv = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--"]
        proc = run_owned(
            [*argv, "sh", "-ec", " && ".join(steps)],
            input=json.dumps({**spec, "tmp": tmp}),
            capture_output=True,
            text=True,
            timeout_s=timeout_s,
            cwd=ROOT,
        )
    marked = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not marked:
        raise AssertionError(
            f"isolated scenario {target} failed (rc {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(marked[-1][len(RESULT_MARK) :])


def _main() -> None:
    interfaces = [name for _, name in socket.if_nameindex()]
    if interfaces != ["lo"]:
        sys.exit(f"refusing to run: interfaces {interfaces} (only lo expected)")
    module_name, _, function_name = sys.argv[1].partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    spec = json.loads(sys.stdin.read())
    result = function(spec)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main()
