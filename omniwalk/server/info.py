"""GET /version: the installed omniwalk's version, as vLLM's /version answers it."""

from __future__ import annotations

from fastapi import APIRouter

from omniwalk.version import package_version


def info_router() -> APIRouter:
    router = APIRouter()

    @router.get("/version")
    async def version():
        return {"version": package_version()}

    return router
