"""`specserve serve` once the engine is loaded (api/cli.py loads it): bind, print the ready line, drain
gracefully on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from specserve.engine.async_engine import AsyncEngine

from .app import SERVING_KEY, build_app

logger = logging.getLogger("specserve.api")


class MalformedRequestFilter(logging.Filter):
    """aiohttp logs a client's malformed HTTP (not HTTP at all, a bad version, overlong headers) as an
    ERROR with a traceback: any client could fill the log with them. They become one WARNING line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg = f"malformed request rejected ({record.getMessage()}): {type(exc).__name__}"
            record.args = ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


def http_logger() -> logging.Logger:
    """The logger aiohttp's request handler writes its protocol errors to, with the filter above."""
    http_log = logging.getLogger("specserve.http")
    if not any(isinstance(f, MalformedRequestFilter) for f in http_log.filters):
        http_log.addFilter(MalformedRequestFilter())
    return http_log


async def serve(engine: AsyncEngine, settings) -> None:
    """Serve `engine` (built with AsyncEngine.build) until a signal."""
    engine.start()
    name = settings.served_model_name or engine.model_path or "HuggingFaceTB/SmolLM2-135M-Instruct"
    app = build_app(
        engine,
        name,
        api_key=settings.api_key,
        open_paths={p.strip() for p in settings.unauthenticated_paths.split(",") if p.strip()},
        max_request_bytes=settings.max_request_bytes,
        max_waiting=settings.max_waiting_requests,
        read_timeout=settings.request_read_timeout,
        log_stats_interval=settings.log_stats_interval,
        access_log=not settings.no_access_log,
        max_model_len=engine.max_length,
        tool_call_parser=settings.tool_call_parser,
    )
    runner = web.AppRunner(
        app,
        access_log=None,
        logger=http_logger(),
        handle_signals=False,
        shutdown_timeout=settings.shutdown_timeout,
        handler_cancellation=True,  # a client that disconnects cancels its handler -> request aborted
        # Idle connections, and ones still sending their headers (slowloris), close after the read timeout
        # (aiohttp's own default is an hour).
        keepalive_timeout=settings.request_read_timeout,
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    sockets = site._server.sockets if site._server else []  # noqa: SLF001 - the real bound port (port 0)
    port = sockets[0].getsockname()[1] if sockets else settings.port
    print(f"Server ready on http://{settings.host}:{port} (Press CTRL+C to quit)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info(
        "shutting down: no new requests; waiting up to %.0f s for %d in flight",
        settings.shutdown_timeout,
        engine.num_in_flight,
    )
    app[SERVING_KEY].draining = True
    deadline = loop.time() + settings.shutdown_timeout
    while engine.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if engine.num_in_flight:  # out of time: end those streams with a clear error, not a cut connection
        n = engine.fail_all("the server shut down before this request finished")
        logger.warning("shutdown timeout: %d requests ended with an error", n)
    await runner.cleanup()
    await engine.stop()
    logger.info("stopped")
