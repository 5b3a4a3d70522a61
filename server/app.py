"""The HTTP app: OpenAI-compatible routes (server/openai_api.py: /v1/chat/completions,
/v1/completions, /v1/models) and SGLang-native ones (server/native_api.py: /generate,
/get_server_info, /health, /metrics, /flush_cache) over one Scheduler, behind the API-key and
body-size guard, with every error reported as server/errors.py describes."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI

from jaxspec.server import native_api, openai_api, protocol
from jaxspec.server.context import ServerContext
from jaxspec.server.errors import Guard, install_handlers
from jaxspec.server.scheduler import Scheduler

logger = logging.getLogger("jaxspec.server")


def create_app(
    sched: Scheduler,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 16 << 20,
    server_args: dict | None = None,
    manage_scheduler: bool = True,
) -> FastAPI:
    """The app serving `sched`. manage_scheduler: the app starts the scheduler thread at start-up
    and shuts it down (cancelling what is left) at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_scheduler and sched._thread is None:
            sched.start()
        yield
        if manage_scheduler:
            left = sched.running + sched.queue_depth
            logger.warning("shutting down%s", f": cancelling {left} queued or running requests" if left else "")
            await asyncio.get_running_loop().run_in_executor(None, sched.shutdown)

    app = FastAPI(title="jaxspec", lifespan=lifespan)
    app.state.ctx = ServerContext(sched, served_model_name, server_args or {})
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    install_handlers(app, max_body_bytes)
    app.include_router(openai_api.router)
    app.include_router(native_api.router)

    def openapi():
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(protocol.openapi_schemas())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
