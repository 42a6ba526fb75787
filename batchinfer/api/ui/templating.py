"""Rendering the dashboard's pages: the Jinja templates and the security headers every page carries."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fastapi import Request
from fastapi.responses import Response
from fastapi.templating import Jinja2Templates

from batchinfer import __version__

UI_DIR = Path(__file__).resolve().parent
STATIC_DIR = UI_DIR / "static"
# Only our own files run on these pages: no inline script, no other origin (uPlot sets element styles).
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'")

templates = Jinja2Templates(directory=UI_DIR / "templates")
templates.env.globals["version"] = __version__


def render(request: Request, name: str, context: Mapping[str, object], *, status_code: int = 200) -> Response:
    """A template response with the dashboard's security headers."""
    response = templates.TemplateResponse(request, name, dict(context), status_code=status_code)
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-store"
    return response
