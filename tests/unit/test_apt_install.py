"""`make setup` waits for another apt instead of failing: two fresh clones set up at once (or
unattended upgrades) meet apt's lists lock, which `apt-get update` gives up on at once with exit 100
and which apt's DPkg::Lock::Timeout does not cover. Seen here: a CI clone's `make setup` failed with
"Could not get lock /var/lib/apt/lists/lock" while a second `make setup` ran apt-get update.

apt-get is replaced by fake_apt_get (a fault injector on PATH): it reports the lock as held the
first N calls, then records its arguments and succeeds.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.owned_processes import run_owned

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "apt_install.sh"

FAKE_APT_GET = """#!/bin/sh
n=$(cat "$FAKE_DIR/busy")
if [ "$n" -gt 0 ]; then
  echo $((n - 1)) > "$FAKE_DIR/busy"
  echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 1 (apt-get)" >&2
  exit 100
fi
echo "$DEBIAN_FRONTEND $*" >> "$FAKE_DIR/calls"
[ -z "$FAKE_FAIL" ] || { echo "E: Unable to locate package $FAKE_FAIL" >&2; exit 100; }
"""


def _run(tmp_path: Path, busy: int, fail: str = "", timeout_s: int = 600):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "apt-get"
    fake.write_text(FAKE_APT_GET)
    fake.chmod(0o755)
    (tmp_path / "busy").write_text(f"{busy}\n")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_DIR": str(tmp_path),
        "FAKE_FAIL": fail,
        "SUDO": "",
        "APT_LOCK_TIMEOUT_S": str(timeout_s),
        "APT_LOCK_POLL_S": "0.1",
    }
    return run_owned(
        ["bash", str(SCRIPT), "bubblewrap", "prometheus"],
        env=env,
        capture_output=True,
        text=True,
        timeout_s=120,
    )


def test_waits_while_the_lists_lock_is_held_then_installs(tmp_path):
    done = _run(tmp_path, busy=2)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("apt is busy") == 2
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == [
        "noninteractive -o DPkg::Lock::Timeout=60 update -qq",
        "noninteractive -o DPkg::Lock::Timeout=60 install -y -qq bubblewrap prometheus",
    ]


def test_other_errors_fail_at_once_with_apts_message(tmp_path):
    done = _run(tmp_path, busy=0, fail="prometheus")
    assert done.returncode == 1
    assert "Unable to locate package prometheus" in done.stderr
    assert "apt is busy" not in done.stderr


def test_gives_up_after_the_deadline_with_apts_message(tmp_path):
    done = _run(tmp_path, busy=1000, timeout_s=0)
    assert done.returncode == 1
    assert "Could not get lock /var/lib/apt/lists/lock" in done.stderr
