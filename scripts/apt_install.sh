#!/usr/bin/env bash
# apt-get update + install that waits for another apt (a second clone's `make setup`, unattended
# upgrades) instead of failing at once. apt's DPkg::Lock::Timeout covers the dpkg lock but not
# /var/lib/apt/lists/lock, which `apt-get update` takes and gives up on at once (exit 100,
# "Could not get lock"): retried every APT_LOCK_POLL_S (5) s until APT_LOCK_TIMEOUT_S (600) have passed.
#
#   scripts/apt_install.sh PACKAGE...        (SUDO= empty when root)
set -uo pipefail
deadline=$(( $(date +%s) + ${APT_LOCK_TIMEOUT_S:-600} ))
sudo=${SUDO-}
apt_waiting() {  # run apt-get "$@"; retry while another process holds an apt lock
  local err
  while :; do
    err=$($sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=60 "$@" 2>&1 >/dev/null) && return 0
    if ! grep -q "Could not get lock" <<<"$err" || [ "$(date +%s)" -ge "$deadline" ]; then
      echo "$err" >&2
      return 1
    fi
    echo "apt is busy (another apt-get holds its lock): waiting" >&2
    sleep "${APT_LOCK_POLL_S:-5}"
  done
}
apt_waiting update -qq && apt_waiting install -y -qq "$@"
