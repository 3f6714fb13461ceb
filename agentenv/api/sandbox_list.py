"""GET /sandboxes and GET /v2/sandboxes: query parsing, filters, order and paging as E2B's API does them.

Checked against E2B's API (`spec/openapi.yml` and the list handler of e2b-dev/infra):

- `startedAfter` is inclusive ("started at or after") on a microsecond grid: the bound is truncated
  to whole microseconds (Go clients send nanoseconds, JS milliseconds, Python microseconds), so a
  sandbox's own `startedAt` fed back selects it, and `startedAt + 1 s` does not.
- `state`: `running` and/or `paused` (comma-separated or repeated); none means both. A sandbox that
  is pausing is listed as paused.
- `metadata`: `k=v&k2=v2`, URL-encoded as a whole and per key/value; every pair must match.
- `template`: a template ID or alias, resolved to the template, so any alias of the template the
  sandbox was created from matches; `name:tag` is refused (sandboxes are not tag-scoped).
- `order`: by start time, `desc` (default: newest first, ties by sandbox ID ascending) or `asc`
  (the exact reverse: ties by sandbox ID descending).
- `limit` 1..100 (default 100) and `nextToken`: E2B's keyset cursor, base64url of
  `<RFC 3339 start time>__<sandbox ID>` (plus `__asc` for ascending order); a token replayed under
  the other order is refused. `X-Next-Token` is set only when more follow.
- `X-Total-Running`: how many running sandboxes match the filters before paging; only when running
  sandboxes were asked for.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote

from agentenv.errors import BadRequest
from agentenv.models import SandboxRecord, rfc3339

PAGE_LIMIT_MAX = 100
STATES = ("running", "paused")
TOTAL_RUNNING_HEADER = "X-Total-Running"
NEXT_TOKEN_HEADER = "X-Next-Token"
_ASC_MARK = "asc"

# template name or ID -> the template ID it names, or None when no template has that name
TemplateResolver = Callable[[str], Awaitable[str | None]]


@dataclass(frozen=True)
class ListQuery:
    """A validated GET /v2/sandboxes query."""

    states: frozenset[str]
    ascending: bool
    started_after: datetime | None
    template: str | None
    metadata: dict[str, str] | None
    limit: int
    cursor: tuple[datetime, str] | None


def parse_metadata_filter(value: str) -> dict[str, str]:
    """Decodes the `metadata` query value as E2B does (see e2b-protocol.md 3.4).

    `value` is already query-decoded once by the framework; it is `k=v&k2=v2`, URL-encoded once
    more as a whole and again per key/value.
    """
    out: dict[str, str] = {}
    for pair in unquote(value).split("&"):
        if not pair:
            continue
        key, sep, val = pair.partition("=")
        if not sep or not key:
            raise BadRequest(f"Invalid metadata filter {value!r}: expected key=value pairs joined by '&'")
        out[unquote(key)] = unquote(val)
    return out


def _micro(dt: datetime) -> datetime:
    """Aware, UTC, whole microseconds (Python's own precision; longer fractions were cut when parsed)."""
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)


def parse_time(value: str, name: str) -> datetime:
    """An RFC 3339 time of the query; a naive one is UTC, digits past microseconds are dropped."""
    # A literal '+' of an unencoded offset arrives as a space after query decoding.
    try:
        dt = datetime.fromisoformat(value.strip().replace(" ", "+"))
    except ValueError:
        raise BadRequest(f"Invalid {name} {value!r}: expected an RFC 3339 time") from None
    return _micro(dt)


def parse_limit(q: Any) -> int:
    try:
        limit = int(q.get("limit", PAGE_LIMIT_MAX))
    except ValueError:
        limit = 0
    if not 1 <= limit <= PAGE_LIMIT_MAX:
        raise BadRequest(f"Invalid limit {q.get('limit')!r}: expected an integer from 1 to {PAGE_LIMIT_MAX}")
    return limit


def encode_token(started_at: datetime, sandbox_id: str, *, ascending: bool) -> str:
    raw = f"{rfc3339(_micro(started_at))}__{sandbox_id}"
    if ascending:
        raw += f"__{_ASC_MARK}"
    return base64.urlsafe_b64encode(raw.encode()).decode()


def decode_token(token: str, *, ascending: bool) -> tuple[datetime, str]:
    """The (start time, sandbox ID) a `nextToken` continues after, for the order it was issued for."""
    bad = BadRequest("Invalid nextToken: pass the X-Next-Token value of a previous response")
    try:
        parts = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode().split("__")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != _ASC_MARK) or not parts[1]:
            raise ValueError("not a token we issued")
        at = datetime.fromisoformat(parts[0])
        if at.tzinfo is None:
            raise ValueError("naive time")
    except (ValueError, UnicodeDecodeError, binascii.Error):
        raise bad from None
    if (len(parts) == 3) != ascending:
        raise BadRequest("Invalid nextToken: it was issued for the other sort order; list again from the "
                         "first page to change the order")
    return _micro(at), parts[1]


def parse_query(q: Any) -> ListQuery:
    """Validate every parameter of GET /v2/sandboxes (400 on the first bad one)."""
    states = frozenset(STATES)
    if q.get("state"):
        # SDKs send `state=running,paused`; repeated `state=` params are accepted too.
        states = frozenset(s.strip() for v in q.getall("state") for s in v.split(",") if s.strip())
        bad = states - set(STATES)
        if bad:
            raise BadRequest(f"Invalid state {sorted(bad)[0]!r}: expected 'running' and/or 'paused'")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest(f"Invalid order {order!r}: expected 'asc' or 'desc'")
    ascending = order == "asc"
    template = q.get("template") or None
    if template is not None and _has_tag(template):
        raise BadRequest(f"Invalid template {template!r}: tags are not supported here because sandboxes "
                         "are not tag-scoped")
    return ListQuery(
        states=states,
        ascending=ascending,
        started_after=parse_time(q["startedAfter"], "startedAfter") if q.get("startedAfter") else None,
        template=template,
        metadata=parse_metadata_filter(q["metadata"]) if "metadata" in q else None,
        limit=parse_limit(q),
        cursor=decode_token(q["nextToken"], ascending=ascending) if q.get("nextToken") else None,
    )


def _has_tag(name: str) -> bool:
    base, sep, tag = name.rpartition(":")
    return bool(sep and base and tag and "/" not in tag)


def match_metadata(recs: Iterable[SandboxRecord], wanted: dict[str, str] | None) -> list[SandboxRecord]:
    if wanted is None:
        return list(recs)
    return [r for r in recs if all(r.metadata.get(k) == v for k, v in wanted.items())]


def sort_key(rec: SandboxRecord) -> tuple[datetime, str]:
    return _micro(rec.started_at), rec.sandbox_id


def in_order(recs: Iterable[SandboxRecord], *, ascending: bool) -> list[SandboxRecord]:
    """E2B's order: desc = newest first, ties by ID ascending; asc = its exact reverse."""
    out = sorted(recs, key=lambda r: r.sandbox_id, reverse=ascending)
    return sorted(out, key=lambda r: _micro(r.started_at), reverse=not ascending)


def _after_cursor(rec: SandboxRecord, cursor: tuple[datetime, str], ascending: bool) -> bool:
    at, sandbox_id = sort_key(rec)
    if ascending:
        return at > cursor[0] or (at == cursor[0] and sandbox_id < cursor[1])
    return at < cursor[0] or (at == cursor[0] and sandbox_id > cursor[1])


async def _template_filter(recs: list[SandboxRecord], name: str, resolve: TemplateResolver | None) -> list[SandboxRecord]:
    template_id = await resolve(name) if resolve is not None else None
    if template_id is not None:
        return [r for r in recs if r.template_id == template_id]
    # No template by that name (e.g. a snapshot's ID or name the sandbox was created from).
    return [r for r in recs if name in (r.template_id, r.alias)]


@dataclass
class ListPage:
    items: list[SandboxRecord]
    next_token: str | None
    total_running: int | None  # for X-Total-Running; None when running ones were not asked for


async def list_page(recs: Iterable[SandboxRecord], query: ListQuery,
                    resolve_template: TemplateResolver | None = None) -> ListPage:
    """Filter, order and cut one page of GET /v2/sandboxes."""
    recs = [r for r in match_metadata(recs, query.metadata) if r.state.public in query.states]
    if query.started_after is not None:
        recs = [r for r in recs if _micro(r.started_at) >= query.started_after]
    if query.template is not None:
        recs = await _template_filter(recs, query.template, resolve_template)
    total_running = sum(r.state.public == "running" for r in recs) if "running" in query.states else None
    recs = in_order(recs, ascending=query.ascending)
    if query.cursor is not None:
        recs = [r for r in recs if _after_cursor(r, query.cursor, query.ascending)]
    page = recs[: query.limit]
    token = None
    if len(recs) > query.limit:
        token = encode_token(page[-1].started_at, page[-1].sandbox_id, ascending=query.ascending)
    return ListPage(page, token, total_running)
