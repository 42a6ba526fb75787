"""The dashboard's sign-in: the same API keys as the REST API, carried by an HttpOnly cookie.

`POST /ui/login` checks the key like a Bearer token and answers with a cookie holding it. Why a cookie set
by a POST rather than the key in sessionStorage:

- HttpOnly: no script on the page can read the key, so an injected script could not carry it away;
- the browser sends it by itself, so download links are plain links and htmx needs no glue;
- SameSite=Strict and Path=/ui: no other site's page can make the browser send it, and the REST API
  under /v1 never sees it (it accepts only `Authorization: Bearer`);
- a session cookie (no Max-Age): like sessionStorage it is gone when the browser closes.

State-changing dashboard requests (upload, cancel, sign-out) must also carry htmx's `HX-Request` header:
a cross-site form cannot set a custom header, so even a browser without SameSite cannot be led to post
them (CSRF). The sign-in form itself is a plain form (no script before signing in), so `POST /ui/login`
is refused (403) when the browser says it comes from another site: `Sec-Fetch-Site` other than
same-origin / none, or an `Origin` (else a `Referer`) whose host is not this server's (login CSRF would
sign the user into the attacker's key, and the attacker would then read whatever the user uploads).

Every check happens on every request against the key table (through the API's short auth
cache), so a revoked key stops working on the dashboard as soon as on the REST API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar
from urllib.parse import urlsplit

from fastapi import Depends, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy.orm import Session

from batchinfer.api.deps import Caller, SessionsDep, SettingsDep
from batchinfer.api.errors import APIError

COOKIE_NAME = "batchinfer_ui_key"
UI_PATH = "/ui"
LOGIN_PATH = f"{UI_PATH}/login"
HTMX_HEADER = "HX-Request"

T = TypeVar("T")


class LoginRequired(Exception):
    """No usable key: a page goes to the sign-in form, an htmx request is told to go there."""


class NotHtmx(Exception):
    """A state-changing dashboard request without the HX-Request header (see the module docstring)."""


async def ui_caller(request: Request, settings: SettingsDep, sessions: SessionsDep) -> Caller:
    """The dashboard's caller: the key from the cookie (none needed when auth is disabled)."""
    key = request.cookies.get(COOKIE_NAME) or None
    if key is None and not settings.auth_disabled:
        raise LoginRequired()
    return Caller(settings, sessions, key, request.app.state.auth_cache)


UiCallerDep = Annotated[Caller, Depends(ui_caller)]


async def htmx_only(request: Request) -> None:
    """Refuse a state-changing request that does not come from the dashboard's own scripts."""
    if request.headers.get(HTMX_HEADER) != "true":
        raise NotHtmx()


class CrossSite(Exception):
    """A sign-in posted from another site's page (login CSRF, see the module docstring)."""


_SAME_SITE_FETCHES = frozenset({"same-origin", "none"})  # Sec-Fetch-Site of our own page / a typed URL


async def same_origin_only(request: Request) -> None:
    """Refuse a form post a browser says comes from another origin (Sec-Fetch-Site, else Origin)."""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site.lower() not in _SAME_SITE_FETCHES:
        raise CrossSite()
    origin = request.headers.get("origin") or request.headers.get("referer")
    if origin is None:  # not a browser's cross-site post: browsers send Origin with every form POST
        return
    hosts = {request.headers.get("host", "").lower(), request.headers.get("x-forwarded-host", "").lower()}
    if origin == "null" or urlsplit(origin).netloc.lower() not in hosts - {""}:
        raise CrossSite()


async def cross_site_handler(_request: Request, _exc: Exception) -> Response:
    """CrossSite -> 403 with the reason."""
    return Response("Sign-in refused: the form was posted from another site. Open this server's /ui/login "
                    "and sign in there.", status_code=403, media_type="text/plain")


async def read_as_ui(caller: Caller, work: Callable[[Session, str], T]) -> T:
    """caller.read(work), with an unknown or revoked key turned into LoginRequired."""
    try:
        return await caller.read(work)
    except APIError as exc:
        if exc.status_code == 401:
            raise LoginRequired() from None
        raise


def sign_in(response: Response, request: Request, key: str) -> Response:
    """Put the key in the dashboard's cookie (see the module docstring for its attributes)."""
    response.set_cookie(COOKIE_NAME, key, httponly=True, samesite="strict", path=UI_PATH,
                        secure=request.url.scheme == "https")
    return response


def sign_out(response: Response) -> Response:
    """Drop the dashboard's cookie."""
    response.delete_cookie(COOKIE_NAME, path=UI_PATH, httponly=True, samesite="strict")
    return response


def go_to(request: Request, path: str) -> Response:
    """Navigate: HX-Redirect for an htmx request (it would swap a redirect's page in place), else a 303."""
    if request.headers.get(HTMX_HEADER) == "true":
        return Response(status_code=200, headers={"HX-Redirect": path})
    return RedirectResponse(path, status_code=303)


async def login_required_handler(request: Request, _exc: Exception) -> Response:
    """LoginRequired -> the sign-in form (401 with HX-Redirect for htmx, else a 303 redirect)."""
    if request.headers.get(HTMX_HEADER) == "true":
        return sign_out(Response(status_code=401, headers={"HX-Redirect": LOGIN_PATH}))
    return sign_out(RedirectResponse(LOGIN_PATH, status_code=303))


async def not_htmx_handler(_request: Request, _exc: Exception) -> Response:
    """NotHtmx -> 403 with the reason."""
    return Response("This dashboard action must be sent by the dashboard page (HX-Request header).",
                    status_code=403, media_type="text/plain")
