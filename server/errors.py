"""Errors as the API reports them, and what guards every request before a route sees it.

Every error is an OpenAI-style JSON body {"error": {"message", "type", "code"}}, never a
traceback: 400 bad input (too long a prompt, invalid parameters, a body that is not strict JSON),
401 missing/wrong API key, 404 unknown model or path, 413 oversized body, 503 (with Retry-After)
full queue or shutting down, 500 a bug (logged with its traceback on the server).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Mapping

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxspec.errors import JaxspecError

logger = logging.getLogger("jaxspec.server")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers or {}


def error_body(status: int, message: str, type_: str) -> dict:
    return {"object": "error", "error": {"message": message, "type": type_, "param": None, "code": status}}


def error_response(status: int, message: str, type_: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_), status_code=status, headers=headers)


class BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: API key (all routes but /health) and request-body size limit."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope["path"] != "/health":
            auth = headers.get(b"authorization", b"")
            if not hmac.compare_digest(auth, b"Bearer " + self.api_key.encode()):  # constant time
                resp = error_response(
                    401, "invalid or missing API key (send 'Authorization: Bearer <key>')", "AuthenticationError"
                )
                return await resp(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            resp = error_response(
                413, f"request body of {int(length)} bytes exceeds the limit of {self.max_body}", "RequestTooLarge"
            )
            return await resp(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge()
            return msg

        return await self.app(scope, counted, send)


def install_handlers(app: FastAPI, max_body_bytes: int) -> None:
    """Turns every exception a route can raise into its error body (the module docstring)."""

    @app.exception_handler(HTTPError)
    async def _http_error(request, e: HTTPError):
        return error_response(e.status, e.message, e.type, e.headers)

    @app.exception_handler(JaxspecError)
    async def _user_error(request, e: JaxspecError):
        return error_response(400, str(e), "BadRequestError")

    @app.exception_handler(RequestValidationError)
    @app.exception_handler(ValidationError)
    async def _validation(request, e):
        parts = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            part = f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))
            if part not in parts:
                parts.append(part)
        more = f" (and {len(parts) - 4} more)" if len(parts) > 4 else ""
        return error_response(400, "invalid request: " + "; ".join(parts[:4]) + more, "BadRequestError")

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request, e: StarletteHTTPException):  # unknown path (404) or method (405)
        type_ = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(e.status_code, "BadRequestError")
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type_, e.headers)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request, e):
        return error_response(413, f"request body exceeds the limit of {max_body_bytes} bytes", "RequestTooLarge")

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal server error: {type(e).__name__}", "InternalServerError")


def openapi_body(name: str) -> dict:
    """OpenAPI request body of a route that parses its JSON itself (see parse_json)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
    }


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object: strict JSON (no NaN / Infinity), UTF-8 without unpaired
    surrogates; raises HTTPError 400 naming the problem."""
    try:
        data = json.loads(raw or b"null", parse_constant=_no_constant)
    except RecursionError:
        raise HTTPError(400, "the request body is nested too deeply", "BadRequestError") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, integers of more than 4300 digits
        raise HTTPError(400, f"the request body is not valid JSON: {e}", "BadRequestError") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object", "BadRequestError")
    where = _bad_string(data, "")
    if where is not None:
        raise HTTPError(
            400, f"{where or 'body'}: strings must be valid Unicode (unpaired surrogate)", "BadRequestError"
        )
    return data


def _bad_string(x, path: str) -> str | None:
    """Path of the first string (key or value) holding an unpaired surrogate, else None."""
    stack = [(x, path)]
    while stack:
        x, path = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(x, dict):
            for k, v in x.items():
                p = f"{path}.{k}" if path else str(k)
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
                stack.append((v, p))
        elif isinstance(x, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(x))
    return None
