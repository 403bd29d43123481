"""Errors in the OpenAI envelope: `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations

from typing import Any

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    """An error answered with `status` and the OpenAI error envelope."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code, **self.extra)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code, **extra}}


def bad_request(message: str, param: str | None = None, code: str | None = None, **extra: Any) -> APIError:
    return APIError(400, message, param=param, code=code or "invalid_request", **extra)


def not_supported(param: str, what: str | None = None) -> APIError:
    return APIError(400, f"{what or param} is not supported by this server", param=param,
                    code="unsupported_parameter")


def service_unavailable(message: str, retry_after: int = 1, code: str = "unavailable") -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(retry_after)})
