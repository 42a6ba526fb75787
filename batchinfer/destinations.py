"""Where a schedule may send things (README "Security"): webhook URLs and schedule file paths.

A schedule runs unattended with the rights of the worker process, so its definition must not turn it
into a way to reach what its author could not:

- a webhook is http(s) to a public address: loopback, link-local (cloud metadata at 169.254.169.254),
  private, multicast and reserved addresses are refused unless `webhook_allow_private` (a host name
  counts by every address it resolves to). `schedule add` checks only its form (`check_webhook_form`:
  scheme, host syntax, port, and an address written in the URL), since the receiver's name need not
  resolve from where the schedule is added; each delivery checks the addresses the name resolves to
  then and connects to the one it checked (`pinned_webhook_request`), so a name that resolves elsewhere
  a moment later (DNS rebinding) cannot redirect the POST;
- input globs and output paths stay inside `schedule_roots` (default: the data dir), checked on the
  template at `schedule add` and on each rendered path at run time (a date format may hold '..'). A
  relative template is made absolute at `schedule add`, against the directory `add` ran in
  (`absolute_template`), so every ticking process reads and writes the same files.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from batchinfer.config import Settings

WEBHOOK_SCHEMES = ("http", "https")
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
MAX_HOST_CHARS = 253
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class DestinationRefused(ValueError):
    """A webhook URL or a schedule path that the settings do not allow; the message names the setting."""


@dataclass(frozen=True)
class PinnedRequest:
    """Where to send a webhook: the URL with its host replaced by a checked address, and what keeps the
    original name for the receiver (the Host header) and for TLS (SNI and certificate checks)."""

    url: str
    headers: dict[str, str]
    extensions: dict[str, str]


def pinned_webhook_request(url: str, *, allow_private: bool) -> PinnedRequest:
    """Check `url` as check_webhook_url does and pin it to the first address checked (unless private
    addresses are allowed: then there is nothing to pin against, and the URL goes as it is)."""
    address = check_webhook_url(url, allow_private=allow_private)
    if address is None:
        return PinnedRequest(url, {}, {})
    parts = urlsplit(url)
    if parts.hostname is None:  # check_webhook_url refused such a URL
        raise ValueError(f"{url}: no host")
    host = f"[{address}]" if address.version == 6 else str(address)
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    pinned = urlunsplit(parts._replace(netloc=netloc))
    host_header = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    extensions = {"sni_hostname": parts.hostname} if parts.scheme.lower() == "https" else {}
    return PinnedRequest(pinned, {"Host": host_header}, extensions)


def check_webhook_form(url: str, *, allow_private: bool) -> None:
    """Raise DestinationRefused unless `url` is http(s) with a valid port and a host that is a valid DNS
    name or a public address (any address when private ones are allowed); a name is not resolved here."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in WEBHOOK_SCHEMES or not parts.hostname:
        raise DestinationRefused(f"webhook: {url[:200]!r} is not an http:// or https:// URL with a host")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
    except ValueError as exc:
        raise DestinationRefused(f"webhook: {url[:200]!r} has an invalid port ({exc})") from None
    host = parts.hostname
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        address = None
    if address is not None:
        if not allow_private:
            _refuse_private(host, address)
        return
    try:
        ascii_host = host.encode("idna").decode("ascii").rstrip(".")
    except UnicodeError:
        ascii_host = ""
    if (not ascii_host or len(ascii_host) > MAX_HOST_CHARS
            or not all(_HOST_LABEL.fullmatch(label) for label in ascii_host.split("."))):
        raise DestinationRefused(f"webhook: {host[:200]!r} is not a valid host name (letters, digits and "
                                 "'-' in dot-separated labels, e.g. hooks.example.com)")


def _refuse_private(host: str, address: IPAddress) -> None:
    if not address.is_global or address.is_multicast:
        raise DestinationRefused(
            f"webhook: {host} is {address}, a loopback, link-local, private or reserved "
            "address; use a public receiver, or set webhook_allow_private = true to allow it")


def check_webhook_url(url: str, *, allow_private: bool) -> IPAddress | None:
    """Raise DestinationRefused unless `url` is http(s) to a host whose every address is public; returns
    the first of them (None when private addresses are allowed, which skips resolving)."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in WEBHOOK_SCHEMES or not parts.hostname:
        raise DestinationRefused(f"webhook: {url[:200]!r} is not an http:// or https:// URL with a host")
    if allow_private:
        return None
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        raise DestinationRefused(f"webhook: cannot resolve the host of {url[:200]!r} ({exc})") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    for address in addresses:
        _refuse_private(parts.hostname, address)
    if not addresses:
        raise DestinationRefused(f"webhook: the host of {url[:200]!r} resolves to no address")
    return addresses[0]


def absolute_template(template: str, *, base: Path | None = None) -> str:
    """A path template made absolute against `base` (default: the working directory), `~` expanded; not
    normalized, so a '..' stays for check_schedule_path to judge once rendered."""
    expanded = os.path.expanduser(template)
    return expanded if os.path.isabs(expanded) else os.path.join(base or Path.cwd(), expanded)


def schedule_roots(settings: Settings) -> list[Path]:
    """The directories schedule inputs and outputs must stay in: schedule_roots, else the data dir."""
    roots = settings.schedule_roots or [settings.data_dir]
    return [Path(root).expanduser().resolve() for root in roots]


def check_schedule_path(path: str, roots: Sequence[Path], *, field: str) -> None:
    """Raise DestinationRefused unless `path` (relative paths from the working directory, symlinks
    followed, a glob's magic left as it is) lies inside one of `roots`."""
    resolved = Path(path).expanduser().resolve()
    if not any(resolved.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(root) for root in roots)
        raise DestinationRefused(
            f"{field}: {path!r} is outside the directories schedules may use ({allowed}); move the files "
            "there, or add a directory to the schedule_roots setting")
