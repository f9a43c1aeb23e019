"""Deterministic command policy from YAML (`policies/default.yaml` is the packaged default).

`PolicySet.load(path)` reads every named policy; `Policy.evaluate(command)` returns the verdict
before the command runs: the first matching `deny` rule in file order, else the first matching
`flag` rule, else `allow`. Commands are matched as typed and with quotes/backslashes removed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml

Verdict = Literal["allow", "flag", "deny"]
_VERDICTS = ("deny", "flag")
_UNQUOTE = re.compile(r"[\"'\\]")


@dataclass(frozen=True)
class PolicyVerdict:
    verdict: Verdict
    rule: str | None

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "rule": self.rule}


ALLOW = PolicyVerdict("allow", None)


@dataclass(frozen=True)
class Rule:
    name: str
    verdict: Literal["flag", "deny"]
    pattern: re.Pattern
    description: str = ""


@dataclass(frozen=True)
class Policy:
    name: str
    rules: tuple[Rule, ...]
    network: bool = False

    def evaluate(self, command: str) -> PolicyVerdict:
        """Verdict for `command` (pure, deterministic)."""
        texts = (command, _UNQUOTE.sub("", command))
        for wanted in _VERDICTS:
            for rule in self.rules:
                if rule.verdict == wanted and any(rule.pattern.search(t) for t in texts):
                    return PolicyVerdict(rule.verdict, rule.name)
        return ALLOW


@dataclass(frozen=True)
class PolicySet:
    policies: dict[str, Policy]

    def get(self, name: str) -> Policy | None:
        return self.policies.get(name)

    @classmethod
    def load(cls, path: Path | None = None) -> "PolicySet":
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
            pattern = re.compile(r["pattern"])
        except re.error as exc:
            raise ValueError(f"{where}: bad pattern: {exc}") from None
        rules.append(Rule(r["name"], r["verdict"], pattern, r.get("description", "")))
    network = bool(spec.get("network", parent.network if parent else False))
    return Policy(name, tuple(rules), network)
