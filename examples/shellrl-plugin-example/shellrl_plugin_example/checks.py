"""Two check types (entry point group `shellrl.checks`).

{"type": "answer_is_palindrome", "min_length": 3}
    the final answer, lower-cased without spaces, reads the same backwards
{"type": "file_line_count", "path": "out.txt", "lines": 5}
    the workspace file `path` has exactly `lines` lines (read through the sandbox)
"""

from __future__ import annotations

from shellrl.contract import TaskValidationError


class AnswerIsPalindrome:
    """An answer-only check: needs no workspace, runs synchronously (in a worker thread)."""

    PARAMETERS = {"min_length": "int = 1"}  # optional; listed by the verifier's GET /v1/checks

    @staticmethod
    def validate(params: dict) -> None:
        unknown = set(params) - {"min_length"}
        if unknown:
            raise TaskValidationError(sorted(unknown)[0], "unknown parameter")
        length = params.get("min_length", 1)
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise TaskValidationError("min_length", "must be an integer >= 1")

    @staticmethod
    def run(params: dict, answer: str | None, workspace, timeout_s: float) -> tuple[bool, str]:
        if answer is None:
            return False, "no final answer"
        text = "".join(answer.lower().split())
        if len(text) < params.get("min_length", 1):
            return False, f"answer shorter than {params.get('min_length', 1)} characters"
        return (True, "a palindrome") if text == text[::-1] else (False, f"{text!r} is not")


class FileLineCount:
    """A workspace check: reads a file through the verifier's Workspace (a coroutine)."""

    PARAMETERS = {"path": "str (relative)", "lines": "int"}

    @staticmethod
    def validate(params: dict) -> None:
        if not isinstance(params.get("path"), str) or not params["path"]:
            raise TaskValidationError("path", "a relative path is required")
        if params["path"].startswith("/"):
            raise TaskValidationError("path", "must be relative to the workspace")
        if not isinstance(params.get("lines"), int) or params["lines"] < 0:
            raise TaskValidationError("lines", "must be an integer >= 0")

    @staticmethod
    async def run(params: dict, answer: str | None, workspace, timeout_s: float):
        if workspace is None:
            from services.verifier.workspace_checks import CheckInfraError

            raise CheckInfraError("file_line_count needs the episode's sandbox session")
        from services.verifier.workspace_checks import FileRefused

        try:
            data = await workspace.read_file(params["path"], 1 << 20)
        except FileRefused as exc:
            return False, f"{params['path']}: {exc}"
        n = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
        return n == params["lines"], f"{n} lines (expected {params['lines']})"
