"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a one-line message."""

from __future__ import annotations

MAX_MESSAGE = 400


def one_line(text: str) -> str:
    """The first non-empty line of ``text``, cut to :data:`MAX_MESSAGE` characters."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    line = lines[0] if lines else "error"
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "..."


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body.

    Args:
        status: HTTP status (4xx: the client's mistake; 5xx: ours or overload).
        message: what went wrong (cut to one line).
        type: OpenAI error type (``invalid_request_error``, ``not_found_error``, ``rate_limit_error``...).
        param: the body field at fault, dotted (``messages.0.content``), or None.
        headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(one_line(message))
        self.status, self.type, self.param, self.headers = status, type, param, headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}
