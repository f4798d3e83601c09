"""Named proxy errors and the handlers that turn every failure into the client API's own error
shape: OpenAI's everywhere, Anthropic's on the Messages routes; and whether a client hung up
before its answer (recorded as 499).

No traceback reaches a client: unexpected exceptions are logged here and answered with a 500
in the same JSON shape.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Mapping
from typing import Any, cast

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.types import Message

from recorder.errors import StoreError, StoreValueError

log = logging.getLogger("rl_proxy.proxy")


class ProxyError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(ProxyError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ProxyError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ProxyError):
    status = 403
    type = "permission_error"


class SessionEnded(ProxyError):
    status = 409
    type = "invalid_request_error"
    code = "session_ended"


class NotFound(ProxyError):
    status = 404
    type = "not_found_error"


class BodyTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(ProxyError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


def require_json(request: Request) -> None:
    """Refuse a body not sent as JSON. A web page can POST to a loopback proxy without a CORS
    preflight only as text/plain, a form or a bare blob: read as JSON anyway, such a body
    recorded calls into any session named in its URL."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json" and not kind.endswith("+json"):
        shown = repr(kind) if kind else "no content type"
        raise UnsupportedMediaType(
            f"the request body must be JSON sent with 'Content-Type: application/json', and it came with {shown}"
        )


class BodyTimeout(ProxyError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class StoreUnavailable(ProxyError):
    """The store could not take a write (locked, down): nothing is answered that is not recorded,
    and a 503 tells clients to retry, which the OpenAI and Anthropic SDKs do by themselves."""

    status = 503
    type = "service_unavailable"
    code = "store_unavailable"


class UpstreamUnreachable(ProxyError):
    status = 502
    type = "upstream_error"
    code = "upstream_unreachable"


class UpstreamTimeout(ProxyError):
    status = 504
    type = "upstream_error"
    code = "upstream_timeout"


def error_body(message: str, type_: str, code: str | int | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_response(data: object, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status, headers=headers, media_type="application/json")


ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def _answer(
    path: str, status: int, message: str, type_: str, code: str | int | None = None, param: str | None = None
) -> Response:
    if "/messages" in path:
        return json_response(anthropic_error_body(status, message), status)
    return json_response(error_body(message, type_, code, param), status)


def refusal(path: str, exc: ProxyError) -> Response:
    """A ProxyError as the API at `path` answers it."""
    response = _answer(path, exc.status, exc.message, exc.type, exc.code, exc.param)
    if isinstance(exc, BodyTimeout):  # the rest of its body may still come: not a new request
        response.headers["connection"] = "close"
    return response


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> Response:
        return refusal(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(exc)
        return _answer(request.url.path, 400, message, "invalid_request_error", param=where or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _answer(request.url.path, exc.status_code, str(exc.detail), kind)

    @app.exception_handler(StoreValueError)
    async def unstorable(request: Request, exc: StoreValueError) -> Response:
        return _answer(request.url.path, 400, f"a value the store cannot hold: {exc}", "invalid_request_error")

    @app.exception_handler(StoreError)
    async def store_down(request: Request, exc: StoreError) -> Response:
        log.error("store error on %s %s: %s", request.method, request.url.path, exc)
        message = f"the store is unavailable: {exc}"
        return _answer(request.url.path, 503, message, StoreUnavailable.type, StoreUnavailable.code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _answer(request.url.path, 500, f"internal proxy error ({type(exc).__name__})", "internal_error")


def client_gone(request: Request) -> bool:
    """Whether the client hung up: its next ASGI message if it is already there (a disconnect),
    never waiting for one, by taking one step of the receive coroutine. Starlette's
    `Request.is_disconnected` does the same through an anyio cancel scope, whose cancel formats the
    task's repr and delivers a cancellation through the event loop on every call."""
    step = cast(Coroutine[Any, Any, Message], request.receive())
    try:
        step.send(None)  # done at once, or waiting for a message that is not there yet
    except StopIteration as done:
        return bool(done.value.get("type") == "http.disconnect")
    finally:
        step.close()  # one that waits leaves its wait (uvicorn's Event.wait forgets the waiter)
    return False
