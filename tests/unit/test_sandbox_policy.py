"""Policy engine (services/sandbox/policy.py) and output rendering: pure, no processes."""

from __future__ import annotations

import pytest

from services.sandbox.executor import OutputBuffer, render_output
from services.sandbox.policy import PolicySet, normalize


@pytest.fixture(scope="module")
def default():
    return PolicySet.load().get("default")


@pytest.mark.parametrize("command, verdict, rule", [
    ("rm -rf /", "deny", "rm_root"),
    ("rm -rf /*", "deny", "rm_root"),
    ("rm -fr /usr", "deny", "rm_root"),
    ('rm -rf "/"', "deny", "rm_root"),
    ("cd /tmp && rm -r --force / ; echo", "deny", "rm_root"),
    ("rm -rf --no-preserve-root /", "deny", "rm_root"),
    ("mkfs.ext4 /dev/sda1", "deny", "mkfs"),
    ("dd if=/dev/zero of=/dev/sda bs=1M", "deny", "dd_to_device"),
    (":(){ :|:& };:", "deny", "fork_bomb"),
    ("bomb() { bomb | bomb & }; bomb", "deny", "fork_bomb"),
    ("chmod -R 777 /", "deny", "chmod_chown_root"),
    ("rm -rf ~", "flag", "rm_home"),
    ("rm -rf $HOME/", "flag", "rm_home"),
    ("rm -rf build", "flag", "rm_recursive_or_force"),
    ("rm -f out.txt", "flag", "rm_recursive_or_force"),
    ("find . -name '*.o' -delete", "flag", "find_delete"),
    ("git reset --hard HEAD~1", "flag", "git_destructive"),
    ("kill -9 -1", "flag", "kill_all"),
    ("rm notes.txt", "allow", None),
    ("dd if=/dev/zero of=/dev/null count=1", "allow", None),
    ("ls -la / && cat /etc/os-release", "allow", None),
    ("python3 -c 'print(1)'", "allow", None),
])
def test_default_policy_verdicts(default, command, verdict, rule):
    result = default.evaluate(command)
    assert (result.verdict, result.rule) == (verdict, rule)


def test_deny_wins_over_an_earlier_flag_and_evaluation_is_deterministic(default):
    command = "rm -rf build; rm -rf /"
    assert {default.evaluate(command) for _ in range(5)} == {default.evaluate(command)}
    assert default.evaluate(command).verdict == "deny"


def test_network_policy_extends_default_with_network(tmp_path):
    policies = PolicySet.load()
    assert policies.get("network").network is True and policies.get("default").network is False
    assert [r.name for r in policies.get("network").rules] == [r.name for r in policies.get("default").rules]


@pytest.mark.parametrize("text, message", [
    ("policies: {}", "missing or empty"),
    ("policies: {p: {rules: [{name: a, verdict: maybe, pattern: x}]}}", "verdict must be"),
    ("policies: {p: {rules: [{name: a, verdict: deny, pattern: '('}]}}", "bad pattern"),
    ("policies: {p: {extends: q}}", "unknown policy 'q'"),
    ("policies: {p: {extends: q}, q: {extends: p}}", "cycle"),
    ("policies: {p: {network: true, colour: red}}", "unknown keys"),
])
def test_policy_file_mistakes_fail_naming_the_policy(tmp_path, text, message):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        PolicySet.load(path)


def test_megabyte_commands_are_normalized_and_evaluated(default):
    assert default.evaluate("x='" + "a" * 1_000_000 + "'; echo ${#x}").verdict == "allow"
    heredoc = "cat > data <<'EOF'\n" + "some data line 12345\n" * 30_000 + "EOF\nrm -rf /"
    assert default.evaluate(heredoc).rule == "rm_root"
    assert normalize(" ".join(["w"] * 130)).count("\n") == 2
    assert normalize("a" * 100 + " b") == "W b"


def test_output_rendering_keeps_head_and_tail_with_a_marker():
    buffer = OutputBuffer(10)
    for chunk in (b"0123", b"456789", b"abcdefghij"):
        buffer.feed(chunk)
    assert buffer.truncated_bytes == 10
    assert buffer.text() == "01234\n…[truncated 10 bytes]…\nfghij"
    assert render_output(b"a\xffb\x00", b"", 4) == "a\ufffdb\x00"
