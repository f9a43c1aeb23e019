"""Deterministic command policy from YAML (`policies/default.yaml` is the packaged default).

`PolicySet.load(path)` reads every named policy; `Policy.evaluate(command)` returns the verdict
before the command runs: the first matching `deny` rule in file order, else the first matching
`flag` rule, else `allow`. Commands are matched as typed and with quotes/backslashes removed.

Cost is kept linear in the command length by matching a normalized text: every token of 65 or
more non-blank characters (data, not a command word or flag) becomes `W`, and a line break is
inserted after every 64 words, so no simple command seen by a rule exceeds 64 words (a longer
`rm a b … /` is still flagged by its first words, but a deny on a target past the 64th word is
missed; the sandbox's read-only root contains it anyway). As a backstop the patterns run on the
`regex` engine with a time budget (`EVALUATION_BUDGET_S`, enforced loosely by the engine): a
command whose evaluation takes longer is denied with rule `policy_timeout`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import regex
import yaml

from shellrl.contract.exec import ALLOW, PolicyVerdict

_VERDICTS = ("deny", "flag")
_UNQUOTE = re.compile(r"[\"'\\]")
_LONG_TOKEN = re.compile(r"[^\s;&|()<>]{65,}")
WORDS_PER_LINE = 64


def normalize(text: str) -> str:
    """Long tokens → `W`; a newline after every 64 words (see the module docstring). Linear time."""
    lines = []
    for line in _LONG_TOKEN.sub("W", text).split("\n"):
        words = line.split()
        if len(words) > WORDS_PER_LINE:
            line = "\n".join(" ".join(words[i:i + WORDS_PER_LINE]) for i in range(0, len(words), WORDS_PER_LINE))
        lines.append(line)
    return "\n".join(lines)


TIMEOUT = PolicyVerdict("deny", "policy_timeout")
EVALUATION_BUDGET_S = 2.0


@dataclass(frozen=True)
class Rule:
    name: str
    verdict: Literal["flag", "deny"]
    pattern: regex.Pattern
    description: str = ""


@dataclass(frozen=True)
class Policy:
    name: str
    rules: tuple[Rule, ...]
    network: bool = False

    def evaluate(self, command: str, budget_s: float = EVALUATION_BUDGET_S) -> PolicyVerdict:
        """Verdict for `command`: deterministic for every command evaluated within `budget_s`."""
        texts = (normalize(command), normalize(_UNQUOTE.sub("", command)))
        deadline = time.monotonic() + budget_s
        try:
            for wanted in _VERDICTS:
                for rule in self.rules:
                    if rule.verdict != wanted:
                        continue
                    for text in texts:
                        if rule.pattern.search(text, concurrent=True, timeout=max(1e-3, deadline - time.monotonic())):
                            return PolicyVerdict(rule.verdict, rule.name)
        except TimeoutError:
            return TIMEOUT
        return ALLOW


@dataclass(frozen=True)
class PolicySet:
    policies: dict[str, Policy]

    def get(self, name: str) -> Policy | None:
        return self.policies.get(name)

    @classmethod
    def load(cls, path: Path | None = None) -> PolicySet:
        """Parse a policy file; ValueError naming the policy and rule on any mistake."""
        if path is None:
            text = resources.files("services.sandbox").joinpath("policies/default.yaml").read_text()
            source = "packaged default.yaml"
        else:
            text, source = Path(path).read_text(), str(path)
        raw = yaml.safe_load(text) or {}
        if not isinstance(raw.get("policies"), dict) or not raw["policies"]:
            raise ValueError(f"{source}: top-level 'policies' mapping is missing or empty")
        policies: dict[str, Policy] = {}
        pending = dict(raw["policies"])
        while pending:
            progressed = False
            for name, spec in list(pending.items()):
                parent = (spec or {}).get("extends")
                if parent is not None and parent not in policies:
                    if parent not in pending:
                        raise ValueError(f"{source}: policy {name!r} extends unknown policy {parent!r}")
                    continue
                policies[name] = _parse_policy(source, name, spec or {}, policies.get(parent))
                del pending[name]
                progressed = True
            if not progressed:
                raise ValueError(f"{source}: 'extends' cycle among {sorted(pending)}")
        return cls(policies)


def _parse_policy(source: str, name: str, spec: dict, parent: Policy | None) -> Policy:
    unknown = set(spec) - {"network", "rules", "extends"}
    if unknown:
        raise ValueError(f"{source}: policy {name!r} has unknown keys {sorted(unknown)}")
    rules = list(parent.rules) if parent else []
    for i, r in enumerate(spec.get("rules") or []):
        where = f"{source}: policy {name!r} rule {i} ({r.get('name', '?')})"
        if set(r) - {"name", "verdict", "pattern", "description"} or not {"name", "verdict", "pattern"} <= set(r):
            raise ValueError(f"{where}: needs name, verdict, pattern (and optionally description) only")
        if r["verdict"] not in _VERDICTS:
            raise ValueError(f"{where}: verdict must be 'deny' or 'flag', got {r['verdict']!r}")
        try:
            pattern = regex.compile(r["pattern"], regex.V0)
        except regex.error as exc:
            raise ValueError(f"{where}: bad pattern: {exc}") from None
        rules.append(Rule(r["name"], r["verdict"], pattern, r.get("description", "")))
    network = bool(spec.get("network", parent.network if parent else False))
    return Policy(name, tuple(rules), network)
