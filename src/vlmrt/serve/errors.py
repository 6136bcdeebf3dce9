"""The server's error answers: {"error": {"message", "type", "code", ...}} with an HTTP status."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str = "invalid_request",
                 **extra):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.extra = status, message, type, code, extra

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, **self.extra}}


def bad_request(message: str, code: str = "invalid_request") -> APIError:
    return APIError(400, message, "invalid_request_error", code)


def context_exceeded(prompt_tokens: int, n_ctx: int, detail: str) -> APIError:
    """llama.cpp's error type, with the prompt and context sizes."""
    return APIError(400, f"the request exceeds the available context size: {detail}", "exceed_context_size_error",
                    "context_length_exceeded", n_prompt_tokens=prompt_tokens, n_ctx=n_ctx)


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "unavailable_error", code)


def internal() -> APIError:
    return APIError(500, "internal server error (logged by the server)", "server_error", "internal_error")
