"""Errors the `shellrl` command reports as one line on stderr, without a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class CliError(Exception):
    """A mistake of the user or the environment (a bad flag value, a config file that does not
    parse, a model directory without a tokenizer, a stack that did not start). `cli.main` prints
    `shellrl <command>: error: <message>` and exits with `exit_status` (2 by default, argparse's
    status for a usage error)."""

    def __init__(self, message: str, exit_status: int = 2) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def token_hint(state_dir: str | Path = "<state-dir>") -> str:
    """Where the CLI reads a stack's token (cli.stack_config.api_headers, whose file is
    <state dir>/api_token), for the message of a 401."""
    return (
        "the CLI sends the token of SHELLRL_API_TOKEN, else of the file SHELLRL_API_TOKEN_FILE "
        f"names, else of {Path(state_dir) / 'api_token'} (what `shellrl up` wrote; --state-dir "
        "names another stack's)"
    )


@contextmanager
def http_errors(unreachable: str) -> Iterator[None]:
    """Turn an httpx error raised in the block into one CliError line: an answer with an error
    status names the URL, the status and the body's first 300 characters (a 401: where the
    token is read, `token_hint`); any other
    `httpx.HTTPError` (no connection, a timeout) reads `<unreachable>: <error>`."""
    import httpx

    try:
        yield
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code == 401:
            raise CliError(f"{exc.request.url} refused the token (401): {token_hint()}") from None
        raise CliError(
            f"{exc.request.url} answered {exc.response.status_code}: {exc.response.text[:300]}"
        ) from None
    except httpx.HTTPError as exc:
        raise CliError(f"{unreachable}: {exc}") from None
