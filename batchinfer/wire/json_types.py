"""The JSON alias of free-form bodies (a user's request body, a response body, chat template arguments).

Defined once, so a body is typed as JSON rather than Any. The checker sees the recursive union; at run
time the decoders (msgspec, pydantic) read the alias as "any JSON value", which is what JSON already is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    JSONValue: TypeAlias = str | int | float | bool | None | list["JSONValue"] | dict[str, "JSONValue"]
else:  # msgspec cannot resolve a recursive alias; any decoded JSON value is one of its members anyway
    JSONValue: TypeAlias = Any
JSONObject: TypeAlias = dict[str, JSONValue]
