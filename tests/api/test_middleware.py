"""The error middleware on a real loopback server: a client that vanished mid-write is not a server error."""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from specserve.api.app import error_middleware


async def test_connection_reset_while_writing_is_not_logged_as_internal_error(caplog):
    async def reset_handler(request: web.Request) -> web.StreamResponse:
        # What StreamResponse.prepare raises when the peer closed between our last read and first write.
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    async def broken_handler(request: web.Request) -> web.StreamResponse:
        raise RuntimeError("a real bug")

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/reset", reset_handler)
    app.router.add_get("/broken", broken_handler)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        with caplog.at_level(logging.DEBUG, logger="specserve.api"):
            async with session.get(server.make_url("/reset")) as r:
                assert r.status == 499
            assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
            assert any("client disconnected" in rec.getMessage() for rec in caplog.records)
            # A genuine failure still surfaces as a logged 500 with an OpenAI-style body.
            async with session.get(server.make_url("/broken")) as r:
                assert r.status == 500
                assert (await r.json())["error"]["code"] == "internal_error"
            assert [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
