"""What the processes of one node (:mod:`.multihost`) say to each other, as strict schemas.

Follower -> lead: :class:`Hello` (which process it is), :class:`DataState` (its data position),
parts of arrays (:class:`PartsHeader`). Lead -> follower: a :data:`COMMAND` (one model per
``op``, told apart by it), :class:`Go` before each step of a train that the lead may stop, and
parts. The lead builds its commands from these models; each side parses what it receives with
:func:`~intellect_jax.net.schema.recv_model`, so a message of the wrong form is one
:class:`~intellect_jax.net.errors.FrameError` naming the peer and the field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, TypeAdapter, model_validator

from intellect_jax.net.arrays import MAX_ARRAYS, MAX_NDIM, ArrayHeader
from intellect_jax.net.schema import JsonTuple, Nat, Wire


class Hello(Wire):
    """A follower's first message: its process index (the lead checks it is one of the node's)."""

    process: Annotated[int, Field(ge=1, le=1 << 16)]


def _ordered_ranges(rs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    if any(a >= b for a, b in rs) or any(rs[i][1] > rs[i + 1][0] for i in range(len(rs) - 1)):
        raise ValueError(f"not ascending disjoint [a, b) ranges: {rs[:4]}")
    return rs


# leased global batches of the stream, [a, b) each (a round's: a few ranges)
Ranges = Annotated[list[Annotated[tuple[Nat, Nat], JsonTuple]], Field(min_length=1, max_length=1 << 12),
                   AfterValidator(_ordered_ranges)]


class DataState(Wire):
    """A process's data-iterator position (``DataIterator.get_state()``; the pipeline checks the
    version and fingerprint when it takes it); ``plan``: the batches leased to it (data leases)."""

    version: Annotated[int, Field(ge=0, le=1 << 16)]
    step: Nat
    fingerprint: Annotated[str, Field(max_length=256)]
    plan: Ranges | None = None


# ---- the lead's commands ---------------------------------------------------------------------
class Train(Wire):
    """Run the inner steps up to ``until``; with ``asks``, a :class:`Go` comes before each step."""

    op: Literal["train"] = "train"
    until: Nat
    asks: bool


class Eval(Wire):
    op: Literal["eval"] = "eval"


class Pg(Wire):
    """Send the int8 pieces of ``anchor - params``."""

    op: Literal["pg"] = "pg"


class Init(Wire):
    """Mark the anchor; send the param shards (fp32)."""

    op: Literal["init"] = "init"


class Gather(Wire):
    """Send the shards of the inner optimizer state."""

    op: Literal["gather"] = "gather"


class Data(Wire):
    """Send the data position (a :class:`DataState`)."""

    op: Literal["data"] = "data"


class Place(Wire):
    """Take the slices that follow (params, and the optimizer state with ``opt``), the step
    counter ``step`` (None: keep it) and data position ``data`` (None: keep it)."""

    op: Literal["place"] = "place"
    opt: bool
    step: Nat | None
    data: DataState | None


class Lease(Wire):
    """From now on read this process's rows of the stream's global batches ``ranges`` (the
    round's data, leased by the coordinator to the node), in order."""

    op: Literal["lease"] = "lease"
    ranges: Ranges


class Stop(Wire):
    op: Literal["stop"] = "stop"


Command = Annotated[Train | Eval | Pg | Init | Gather | Data | Place | Lease | Stop, Field(discriminator="op")]
COMMAND: TypeAdapter[Command] = TypeAdapter(Command)


class Go(Wire):
    """The lead's ``stop()`` answer before a step of a train with ``asks``."""

    op: Literal["go"] = "go"
    stop: bool


# ---- parts of arrays ---------------------------------------------------------------------------
def _ordered(b: tuple[int, int]) -> tuple[int, int]:
    if b[0] > b[1]:
        raise ValueError(f"start {b[0]} after stop {b[1]}")
    return b


Bound = Annotated[tuple[Nat, Nat], JsonTuple, AfterValidator(_ordered)]  # (start, stop) in one dimension
Part = Annotated[tuple[Nat, Annotated[list[Bound], Field(max_length=MAX_NDIM)], Nat], JsonTuple]


class PartsHeader(ArrayHeader):
    """An array list of parts: per part its leaf index, bounds and how many of the arrays are its own."""

    parts: Annotated[list[Part], Field(max_length=MAX_ARRAYS)]

    @model_validator(mode="after")
    def _covers(self) -> PartsHeader:
        held = sum(n for _, _, n in self.parts)
        if held != len(self.arrays):
            raise ValueError(f"the parts hold {held} arrays, the header announces {len(self.arrays)}")
        return self
