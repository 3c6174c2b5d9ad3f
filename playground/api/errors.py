"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

from django.http import JsonResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, type="invalid_request_error", param=None, code=None,
                 headers=None, counted=False):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.headers = headers or {}  # e.g. Retry-After on a 429
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}
        self.counted = counted  # in the error metrics already (a job's own error, counted when the job ended)

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body, status=self.status)
        response.error_code = self.body["error"]["code"]  # for the API's log line (api/views.py endpoint)
        if self.status == 401:
            response["WWW-Authenticate"] = "Bearer"
        for name, value in self.headers.items():
            response[name] = value
        return response


def body_too_large() -> ApiError:
    """A body over DATA_UPLOAD_MAX_MEMORY_SIZE: the one 413 that Django's check (views.json_body) and daphne's
    (playground/body_limit.py, as the body arrives) both answer."""
    return ApiError(413, "The request body is too large", code="body_too_large")
