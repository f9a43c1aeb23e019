"""benchmarks/rollout_profile.py's arithmetic: py-spy's raw stacks to own time by function, shared
out over the measured CPU per turn, and grouped by what the time pays for."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.rollout_profile import (
    REPO,
    Phase,
    category_of,
    grouped,
    module_of,
    print_top,
    read_raw,
)

LOOP = "run (asyncio/runners.py:118);BaseEventLoop._run_once (/usr/lib/python3.11/asyncio/base_events.py:1922)"
PROMPT = str(REPO / "services/rollout/prompt.py")
AIOHTTP = "/venv/lib/python3.11/site-packages/aiohttp/client.py"


def test_raw_stacks_give_own_seconds_of_the_innermost_function_on_the_loop_thread():
    raw = "\n".join(
        [
            f"{LOOP};ChatFormat._encode_plain ({PROMPT}:300) 30",
            f"{LOOP};ChatFormat._encode_plain ({PROMPT}:301) 10",  # another line, same function
            f"{LOOP};ClientSession._request ({AIOHTTP}:558) 60",
            f"_Spawner._serve ({REPO}/tests/helpers/owned_processes.py:106) 99",  # another thread
        ]
    )
    own = read_raw(raw, rate_hz=100)
    assert own == {
        (PROMPT, 0, "ChatFormat._encode_plain"): pytest.approx(0.4),
        (AIOHTTP, 0, "ClientSession._request"): pytest.approx(0.6),
    }


def test_shares_of_the_profile_are_spread_over_the_measured_cpu_per_turn():
    phase = Phase({("a", 0, "f"): 3.0, ("b", 0, "g"): 1.0}, count=100, cpu_s=0.5)
    assert phase.per_unit_us(2000.0) == {("a", 0, "f"): 1500.0, ("b", 0, "g"): 500.0}


def test_functions_are_grouped_by_module_and_by_what_they_pay_for():
    encode = (PROMPT, 0, "ChatFormat._encode_plain")
    spans = (str(REPO / "services/rollout/agent_loop.py"), 0, "AgentLoop._append_action")
    request = (AIOHTTP, 0, "ClientSession._request")
    xadd = ("/venv/lib/python3.11/site-packages/redis/asyncio/client.py", 0, "Redis.execute")
    assert module_of(encode) == "services/rollout/prompt.py"
    assert module_of(request) == "aiohttp"
    assert module_of(("/usr/lib/python3.11/asyncio/events.py", 0, "Handle._run")) == "asyncio"
    assert category_of(encode).startswith("token bookkeeping")
    assert category_of(spans) == "version spans"
    assert category_of(xadd).startswith("durability")
    assert category_of(request).startswith("HTTP")
    rows = grouped({encode: 2.0, request: 1.0, spans: 0.5}, module_of)
    assert rows[("~", 0, "services/rollout/prompt.py")] == 2.0
    assert Path(PROMPT).exists()


def test_rows_whose_total_is_zero_print_without_shares(capsys):
    """'added per turn' is turn minus pair by function: the differences can sum to 0 (a short
    phase), which printed ZeroDivisionError; rows with a total print their shares as before."""
    print_top("added", {("~", 0, "f"): 2.0, ("~", 0, "g"): -2.0}, top=5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "added: 0 us of own time in all"
    assert lines[3:] == ["     2.0      -  f", "    -2.0      -  g"]
    print_top("pairs", {("~", 0, "f"): 3.0, ("~", 0, "g"): 1.0}, top=5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[3:] == ["     3.0  75.0%  f", "     1.0  25.0%  g"]
