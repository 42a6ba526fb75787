"""The guard of an API served without authentication (`--auth-disabled`, README "Security").

Without keys, anything that can send the server a request acts as owner 'local'. Binding 127.0.0.1 keeps
other machines out, but not the user's own browser: any web page may post forms to localhost (CSRF) or
reach it through a DNS name that resolves to 127.0.0.1 (DNS rebinding). So every request must arrive
on a loopback address (the ASGI `server`: the local address the connection actually reached, not
settings.api_host, so a server bound to 0.0.0.0 by hand still refuses what comes through a network
interface), name a loopback Host, and carry no Origin but a loopback one; else 403.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from batchinfer.api.errors import error_body


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (the only hosts where auth may be disabled)."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(authority: str) -> str:
    """The host of a Host header value (host, host:port, [v6], [v6]:port)."""
    if authority.startswith("["):
        return authority[1:].split("]", 1)[0]
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


def refusal(scope: Scope) -> str | None:
    """Why a request may not be served without authentication, or None when it may."""
    server = scope.get("server")
    if server is not None and not is_loopback(str(server[0])):  # None: a UNIX socket, local by nature
        return f"the request reached the server on {server[0]}, not on a loopback address"
    headers: dict[bytes, bytes] = dict(scope.get("headers") or ())
    host = headers.get(b"host", b"").decode("latin-1")
    if not is_loopback(_host_of(host)):
        return f"the Host header {host[:100]!r} is not a loopback name"
    origin = headers.get(b"origin")
    if origin is not None:
        origin_host = urlsplit(origin.decode("latin-1")).hostname or ""
        if not is_loopback(origin_host):
            return f"the Origin {origin.decode('latin-1')[:100]!r} is not a loopback page"
    return None


class LoopbackOnly:
    """ASGI middleware: 403 (OpenAI shape) for any request `refusal` refuses."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request, or answer 403 without running it."""
        if scope["type"] in ("http", "websocket"):
            reason = refusal(scope)
            if reason is not None:
                await _forbidden(scope, receive, send, reason)
                return
        await self.app(scope, receive, send)


async def _forbidden(scope: Scope, receive: Receive, send: Send, reason: str) -> None:
    message = (f"Forbidden: authentication is disabled, so only loopback pages and clients may call this "
               f"server, and {reason}. Use http://127.0.0.1, or serve with API keys.")
    body = error_body(message, type="invalid_request_error", code="not_loopback")
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    await JSONResponse(body, status_code=403)(scope, receive, send)
