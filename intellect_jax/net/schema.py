"""Strict schemas for what peers send: every JSON header a node acts on is parsed into a model first.

A peer is untrusted input: a header that is valid JSON but of the wrong form (``{"process": "x"}``,
a list where a number belongs, an unknown field, a non-object) must fail as one
:class:`~.errors.FrameError` naming the peer and the field, never as an ``AttributeError`` or a
``KeyError`` somewhere later. So each header has a :class:`Wire` model beside the code that
reads it (extra fields forbidden, strict types: a string is no int, an int no bool; strings and
lists bounded), and :func:`parse` / :func:`recv_model` turn a validation failure into that one line::

    donor d1: malformed state header: outer_step: Input should be a valid integer (got 'x')

JSON has no tuples, so fixed-length arrays are declared as tuples marked :data:`JsonTuple`
(a JSON list becomes a tuple; its items are still checked strictly).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

from intellect_jax.net.errors import FrameError
from intellect_jax.net.transport import MAX_MSG, Connection, recv_msg

W = TypeVar("W")

Nat = Annotated[int, Field(ge=0, le=2**63 - 1)]  # counts, sizes, steps: what fits an int64
Finite = Annotated[float, Field(allow_inf_nan=False)]
JsonTuple = BeforeValidator(lambda v: tuple(v) if type(v) is list else v)


class Wire(BaseModel):
    """Base of every peer header: unknown fields and loose types are refused; instances are frozen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _shown(x: Any) -> str:
    """The offending value, short (containers by their type only: a repr could be megabytes)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)[:40]
    return type(x).__name__


def _text(s: str, limit: int) -> str:
    """Peer text for a log line: control characters escaped (one line), at most ``limit`` characters."""
    return repr(s[: 4 * limit])[1:-1][:limit]


def _line(e: ValidationError, peer: str, what: str) -> str:
    errs = e.errors(include_url=False)
    first = errs[0]
    loc = _text(".".join(str(p) for p in first["loc"]), 80) or "the whole message"
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{peer}: malformed {what}: {loc}: {_text(first['msg'], 200)} (got {_shown(first.get('input'))}){more}"


def parse(model: type[W] | TypeAdapter[W], msg: Any, peer: str, what: str) -> W:
    """``msg`` (a decoded JSON value) as ``model`` (a :class:`Wire` model, or a ``TypeAdapter`` of
    a union of them); :class:`FrameError` naming ``peer``, ``what`` and the field otherwise."""
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(msg)
        return model.model_validate(msg)  # type: ignore[attr-defined]
    except ValidationError as e:
        raise FrameError(_line(e, peer, what)) from None


def recv_model(conn: Connection, model: type[W] | TypeAdapter[W], what: str, deadline: float | None = None,
               max_len: int = MAX_MSG) -> W:
    """:func:`~.transport.recv_msg`, then :func:`parse`."""
    return parse(model, recv_msg(conn, deadline, max_len), conn.peer, what)
