"""Errors of the data contract."""

from __future__ import annotations


class ContractError(ValueError):
    """Bytes or a message that violate the data contract (bad protobuf, bad array lengths)."""


class TaskValidationError(ValueError):
    """A task (JSON form) that fails validation; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message
