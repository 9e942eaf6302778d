"""Strict schemas of the coordinator's wire messages: every request the service answers and every
reply the client reads.

A message is a JSON object; it is parsed here before anything acts on it. The models forbid
unknown fields and are strict (a string is not an int, an int is not a bool), strings and lists
are bounded, and requests are told apart by ``op`` (a discriminated union). A message that does
not parse is a :class:`~.protocol.ProtocolError` whose one line names the op (or reply) and the
field: ``malformed 'sync' request: report.accused: List should have at least 2 items ...``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from intellect_jax.coordinator.protocol import Admission, Epoch, ProtocolError, Record, RegisterReply, Resume
from intellect_jax.net.audit import MAX_CASE_BYTES, MAX_CASE_RANKS, MAX_PIECES
from intellect_jax.net.evidence import MAX_EVIDENCE_BYTES

MAX_NODES = 4096  # members, joiners and node-id lists (a node holds one coordinator connection: see max_handlers)
MAX_MESSAGE = 4096  # characters of an error reply's message

NodeId = Annotated[str, Field(min_length=1, max_length=128)]
Token = Annotated[str, Field(min_length=1, max_length=64)]
Hash = Annotated[str, Field(min_length=1, max_length=128)]
Signature = Annotated[str, Field(pattern=r"^(?:[0-9a-f]{2}){8,256}$")]  # hex bytes, DER ECDSA
Text = Annotated[str, Field(max_length=256)]
Addr = Annotated[str, Field(min_length=1, max_length=256)]
Count = Annotated[int, Field(ge=0, le=2**53)]
Pair = Annotated[list[Text], Field(min_length=2, max_length=2)]  # (node id, address or hash)
Pairs = Annotated[list[Pair], Field(max_length=MAX_NODES)]
NodeIds = Annotated[list[NodeId], Field(max_length=MAX_NODES)]


class Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# ---- requests ----------------------------------------------------------------------------------
class RecordMsg(Msg):
    """A barrier's record signed by the coordinator (:class:`~.protocol.Record`)."""

    outer_step: Count
    state_hash: Hash
    epoch_id: Count
    members: Annotated[list[NodeId], Field(min_length=1, max_length=MAX_NODES)]
    signature: Signature
    cert: Annotated[str, Field(pattern=r"^(?:[0-9a-f]{2}){16,8192}$")]  # DER, hex

    def parsed(self) -> Record:
        return Record(self.outer_step, self.state_hash, self.epoch_id, tuple(self.members), self.signature,
                      self.cert)


class ResumeMsg(Msg):
    """The state a registering node holds (:class:`~.protocol.Resume`)."""

    outer_step: Count
    epoch_id: Count = 0
    rank: Count = 0
    state_hash: Hash | None = None
    members: NodeIds = []
    record: RecordMsg | None = None

    def parsed(self) -> Resume:
        return Resume(self.outer_step, self.epoch_id, self.rank, self.state_hash, tuple(self.members),
                      None if self.record is None else self.record.parsed())


class DataMsg(Msg):
    """A node's :class:`~.protocol.DataPlan`."""

    leases: bool
    rank: Count = 0
    ranks: Annotated[int, Field(ge=1, le=1 << 20)] = 1

    @model_validator(mode="after")
    def _plan(self) -> DataMsg:
        if self.rank >= self.ranks or (self.leases and self.ranks != 1):
            raise ValueError(f"not a data plan: leases {self.leases}, shard {self.rank} of {self.ranks}")
        return self


class Register(Msg):
    op: Literal["register"]
    node: NodeId
    addr: Addr
    devices: Annotated[int, Field(ge=0, le=1 << 20)]
    protocol: Annotated[int, Field(ge=0, le=1 << 20)]
    fingerprint: Text
    founder: bool = True
    outer_steps: Annotated[int, Field(ge=1, le=2**53)] | None = None
    resume: ResumeMsg | None = None
    data: DataMsg | None = None  # None: not said (a tool, not a training node): nothing to check


class Heartbeat(Msg):
    op: Literal["hb"]
    crl: Annotated[int, Field(ge=0, le=1 << 40)] | None = None  # identities the node's revocation list revokes


class Opening(Msg):
    """A state hash opened (``diloco.state.hash_opening``): the scale a piece is judged by."""

    core: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    numel: Annotated[int, Field(ge=1, le=2**53)]
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False)]  # the outer params' norm


class Evidence(Msg):
    """A bad piece of the accused's own contribution, as it arrived, with the accused's
    signature (``net.evidence``; none in an in-process run)."""

    step: Count
    epoch: Count
    call: Count
    segment: Count
    piece: Count
    numel: Annotated[int, Field(ge=1, le=1 << 20)]
    mode: Annotated[str, Field(pattern=r"^(fp32|bf16|int8|int4|int2|int1|topk[1-9][0-9]{0,4}|top1of[1-9][0-9]{0,2})$")]  # net.quant
    block: Annotated[int, Field(ge=1, le=1 << 16)]
    payload: Annotated[str, Field(max_length=-(-MAX_EVIDENCE_BYTES // 3) * 4)]  # base64
    signature: Annotated[str, Field(pattern=r"^[0-9a-f]{128}$")] | None = None  # r || s, hex
    cert: Annotated[str, Field(pattern=r"^(?:[0-9a-f]{2}){16,4096}$")] | None = None  # the signer's (DER, hex)
    opening: Opening | None = None  # of the recorded hash of outer step ``step``


Hex32 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]  # a SHA-256
Raw64 = Annotated[str, Field(pattern=r"^[0-9a-f]{128}$")]  # a signature, r || s
Mode = Annotated[str, Field(pattern=r"^(fp32|bf16|int8|int4)$")]  # net.butterfly.RING_MODES
Ranks = Annotated[list[Annotated[int, Field(ge=0, lt=MAX_CASE_RANKS)]], Field(max_length=MAX_CASE_RANKS)]


class Audit(Msg):
    """One audited piece of a butterfly segment (``net.audit.Case`` as ``to_wire`` writes it):
    the owner's signed commitment and what the auditor got from every member."""

    step: Count
    epoch: Count
    call: Count
    owner: Annotated[int, Field(ge=0, lt=MAX_CASE_RANKS)]
    auditor: Annotated[int, Field(ge=0, lt=MAX_CASE_RANKS)]
    piece: Annotated[int, Field(ge=0, lt=MAX_PIECES)]
    numel: Annotated[int, Field(ge=1, le=2**53)]
    piece_numel: Annotated[int, Field(ge=1, le=1 << 20)]
    mode: Mode
    block: Annotated[int, Field(ge=1, le=1 << 16)]
    how: Annotated[str, Field(pattern=r"^(mean|clip|cclip|trim[0-9]{1,3})$")]
    absent: Ranks
    # per member, the first piece whose row the owner left out (the pieces' count: none)
    left: Annotated[list[Annotated[int, Field(ge=0, lt=1 << 32)]], Field(min_length=2, max_length=MAX_CASE_RANKS)]
    aggregates: Annotated[list[Hex32], Field(min_length=1, max_length=MAX_PIECES)]
    row_roots: Annotated[list[Hex32], Field(min_length=1, max_length=MAX_PIECES)]
    commit_sig: Raw64
    rows: Annotated[str, Field(max_length=-(-MAX_CASE_RANKS * 96 // 3) * 4)]  # base64
    payloads: Annotated[list[Annotated[str, Field(max_length=-(-MAX_EVIDENCE_BYTES // 3) * 4)]],
                        Field(min_length=2, max_length=MAX_CASE_RANKS)]
    audit_sigs: Annotated[list[Raw64 | None], Field(min_length=2, max_length=MAX_CASE_RANKS)]
    # another commitment of the owner's for the same call, as a member got it: (head, signature)
    other: Annotated[list[Annotated[str, Field(pattern=r"^(?:[0-9a-f]{2})+$", max_length=2 * (32 * (MAX_PIECES + 1) + 4 * MAX_CASE_RANKS))]],
                     Field(min_length=2, max_length=2)] | None = None


class Steering(Msg):
    """A member's rows outsized in most pieces of the reporter's butterfly segment
    (``net.evidence.outsized``), shown by one such piece: every row the reporter (the owner of
    segment ``segment``) may show of it, by rank (None: its own, a sitter's), each with its
    sender's signature to the owner (``net.evidence.outsize_evidence``)."""

    accused: NodeId
    step: Count
    epoch: Count
    call: Count
    segment: Annotated[int, Field(ge=0, lt=MAX_CASE_RANKS)]
    piece: Annotated[int, Field(ge=0, lt=MAX_PIECES)]
    numel: Annotated[int, Field(ge=1, le=1 << 20)]
    mode: Mode
    block: Annotated[int, Field(ge=1, le=1 << 16)]
    ratio: Annotated[float, Field(ge=0, allow_inf_nan=True)]  # (the coordinator computes its own)
    payloads: Annotated[list[Annotated[str, Field(max_length=-(-MAX_EVIDENCE_BYTES // 3) * 4)] | None],
                        Field(min_length=3, max_length=MAX_CASE_RANKS)]
    signatures: Annotated[list[Raw64 | None], Field(min_length=3, max_length=MAX_CASE_RANKS)]


class Accusation(Msg):
    """Another member's bad piece (beyond a report's first, ``accused`` and ``evidence``)."""

    accused: Annotated[list[Text], Field(min_length=2, max_length=2)]
    evidence: Evidence


class Holding(Msg):
    """An all-gather origin's contribution to a failed call as the reporter held it
    (``net.gather``: the codecs that travel whole), after the ranks' digest lists went round: the
    certificate it came with (DER, hex) and per piece its values' count, digest and the origin's
    signature (r || s, hex)."""

    step: Count
    epoch: Count
    call: Count
    origin: NodeId
    mode: Annotated[str, Field(pattern=r"^(int2|int1|topk[1-9][0-9]{0,4}|top1of[1-9][0-9]{0,2})$")]  # net.codecs
    block: Annotated[int, Field(ge=1, le=1 << 16)]
    cert: Annotated[str, Field(pattern=r"^(?:[0-9a-f]{2}){16,8192}$")]
    numels: Annotated[list[Annotated[int, Field(ge=1, le=2**31)]], Field(min_length=1, max_length=MAX_PIECES)]
    digests: Annotated[list[Hex32], Field(min_length=1, max_length=MAX_PIECES)]
    signatures: Annotated[list[Raw64], Field(min_length=1, max_length=MAX_PIECES)]


class Vouch(Msg):
    """An all-gather rank's (``holder``) signed digests of every contribution as it held them,
    per origin in ring order, and the certificate (DER, hex) the reporter checked the signature
    with (``net.gather.Vouch``)."""

    step: Count
    epoch: Count
    call: Count
    holder: NodeId
    entries: Annotated[list[Hex32], Field(min_length=1, max_length=MAX_CASE_RANKS)]
    signature: Raw64
    cert: Annotated[str, Field(pattern=r"^(?:[0-9a-f]{2}){16,8192}$")]  # the holder's, as the reporter checked it


class Missing(Msg):
    """The members whose own pieces of a failed butterfly call never all reached the reporter
    (``net.butterfly``: it names them whatever else failed), in outer step ``step``'s epoch
    ``epoch``."""

    step: Count
    epoch: Count
    nodes: NodeIds


class Report(Msg):
    """A node's word on its last all-reduce: did the average fail its checks, whom it accuses of
    a bad contribution, with why and the evidence (``accused``, ``evidence``; any further member
    it holds a bad piece of in ``more``, one each: a butterfly owner sees every member's pieces
    of its segment), and the piece its audit of a butterfly owner found at fault (``audit``);
    after a failed butterfly call, whose own pieces never reached it (``missing``), and after a
    failed all-gather its holding of each origin (``holdings``) and the ranks' signed digest
    lists, its own and those it got (``vouches``); after one that succeeded, the members whose own pieces it found outsized against the
    others' (``steering``)."""

    avg_failed: bool = False
    accused: Annotated[list[Text], Field(min_length=2, max_length=2)] | None = None
    evidence: Evidence | None = None
    more: Annotated[list[Accusation], Field(max_length=MAX_CASE_RANKS)] | None = None  # one per further accused
    audit: Audit | None = None
    missing: Missing | None = None
    holdings: Annotated[list[Holding], Field(max_length=MAX_CASE_RANKS)] | None = None
    vouches: Annotated[list[Vouch], Field(max_length=MAX_CASE_RANKS)] | None = None
    steering: Annotated[list[Steering], Field(max_length=MAX_CASE_RANKS)] | None = None


class Sync(Msg):
    op: Literal["sync"]
    node: NodeId
    session: Token
    step: Count
    state_hash: Hash | None = None
    retry_of: Count | None = None
    sits_out: Text | None = None
    report: Report | None = None
    vote: Signature | None = None  # the node's signature of (run, step, state_hash)


class Admit(Msg):
    op: Literal["admit"]
    node: NodeId
    session: Token
    requeue: bool = False


class Received(Msg):
    op: Literal["received"]
    node: NodeId
    session: Token
    step: Count


class Leave(Msg):
    op: Literal["leave"]
    node: NodeId
    session: Token


class Status(Msg):
    op: Literal["status"]


class Lease(Msg):
    """The units of the training stream this node trains in round ``round`` (coordinator/leases.py)."""

    op: Literal["lease"]
    node: NodeId
    session: Token
    round: Count
    round_steps: Annotated[int, Field(ge=1, le=1 << 30)]  # H
    unit_steps: Annotated[int, Field(ge=1, le=1 << 30)]
    unit_tokens: Annotated[int, Field(ge=1, le=2**53)]
    stream: Annotated[str, Field(pattern=r"^[0-9a-z-]{0,64}$")] = ""  # the data stream's fingerprint


Request = Annotated[Register | Heartbeat | Sync | Admit | Received | Leave | Status | Lease, Field(discriminator="op")]
OPS = ("register", "hb", "sync", "admit", "received", "leave", "status", "lease")
_REQUEST: TypeAdapter[Request] = TypeAdapter(Request)


# ---- replies -----------------------------------------------------------------------------------
class Ok(Msg):
    ok: Literal[True]


class RegisterOk(Ok):
    """:class:`~.protocol.RegisterReply` on the wire."""

    node_id: NodeId
    session: Token
    member: bool
    outer_step: Count
    epoch_id: Count
    fingerprint: Text
    heartbeat_timeout: Annotated[float, Field(gt=0)]
    note: Annotated[str, Field(max_length=MAX_MESSAGE)] = ""

    def parsed(self) -> RegisterReply:
        return RegisterReply(**self.model_dump(exclude={"ok"}))


class EpochMsg(Msg):
    """:class:`~.protocol.Epoch` on the wire."""

    epoch_id: Count
    outer_step: Count
    members: Annotated[list[Pair], Field(min_length=1, max_length=MAX_NODES)]
    rank: Count
    serve: Pairs = []
    hash_mismatch: Pairs = []
    changed: bool = True
    sitting_out: NodeIds = []
    data: Annotated[list[Count], Field(min_length=2, max_length=2)] | None = None  # tokens trained, discarded
    record: RecordMsg | None = None

    @model_validator(mode="after")
    def _rank_in_ring(self) -> EpochMsg:
        if self.rank >= len(self.members):
            raise ValueError(f"rank {self.rank} outside a ring of {len(self.members)}")
        return self

    def parsed(self) -> Epoch:
        def pairs(ps: list[list[str]]) -> tuple[tuple[str, str], ...]:
            return tuple((a, b) for a, b in ps)

        return Epoch(self.epoch_id, self.outer_step, pairs(self.members), self.rank, pairs(self.serve),
                     pairs(self.hash_mismatch), self.changed, tuple(self.sitting_out),
                     None if self.data is None else (self.data[0], self.data[1]),
                     None if self.record is None else self.record.parsed())


class EpochOk(Ok):
    epoch: EpochMsg


class AdmissionMsg(Msg):
    """:class:`~.protocol.Admission` on the wire."""

    donor_id: NodeId
    donor_addr: Addr
    admitted_at: Annotated[int, Field(ge=-1, le=2**53)]  # -1: resumed with its own state
    outer_step: Count
    epoch_id: Count
    state_hash: Hash | None = None

    def parsed(self) -> Admission:
        return Admission(**self.model_dump())


class AdmissionOk(Ok):
    admission: AdmissionMsg


class View(Msg):
    """A heartbeat's answer: the node as the coordinator sees it."""

    role: Literal["member", "pending", "admitted"]
    admission: Count | None
    donor: NodeId | None
    epoch_id: Count
    epoch_broken: bool
    serving: NodeIds
    completed: bool


class ViewOk(Ok):
    view: View
    crl: Annotated[str, Field(max_length=1 << 20)] | None = None  # the run's revocation list (PEM), if newer


class ReceivedOk(Ok):
    accepted: bool


class StatusOk(Ok):
    status: dict[str, Any]


class LeaseOk(Ok):
    """Sorted, disjoint ``[a, b)`` ranges of unit numbers."""

    units: Annotated[list[Annotated[list[Count], Field(min_length=2, max_length=2)]], Field(min_length=1, max_length=4096)]

    @model_validator(mode="after")
    def _ranges(self) -> LeaseOk:
        end = -1
        for a, b in self.units:
            if not end < a < b:
                raise ValueError(f"units: [{a}, {b}) is empty, or not after the range before")
            end = b
        return self


class ErrorReply(Msg):
    ok: Literal[False]
    error: Annotated[str, Field(min_length=1, max_length=64)]
    reason: Annotated[str, Field(max_length=64)]
    message: Annotated[str, Field(max_length=MAX_MESSAGE)]


# ---- parsing -----------------------------------------------------------------------------------
M = TypeVar("M", bound=Msg)


def _first_error(e: ValidationError, skip: str | None = None) -> str:
    err = e.errors(include_url=False, include_input=False)[0]
    loc = [str(x) if str(x).isprintable() else repr(str(x)) for x in err["loc"]]  # (an extra key is the peer's)
    loc = [x if len(x) <= 40 else x[:40] + "..." for x in loc]
    if loc and loc[0] == skip:  # the union's tag
        loc = loc[1:]
    if err["type"].startswith("union_tag"):  # (pydantic's message would quote the peer's tag)
        return f"op: must be one of {', '.join(OPS)}"
    msg = err["msg"] if err["msg"].isprintable() else repr(err["msg"])
    return f"{'.'.join(loc) or '(message)'}: {msg[:200]}"


def parse_request(raw: Any) -> Request:
    """A request, or :class:`ProtocolError` naming its op and the first bad field."""
    try:
        return _REQUEST.validate_python(raw)
    except ValidationError as e:
        op = raw.get("op") if isinstance(raw, dict) else None
        op = op if isinstance(op, str) else None
        name = f"{op[:40]!r} " if op else ""
        raise ProtocolError(f"malformed {name}request: {_first_error(e, op)}", "malformed") from None


def parse_reply(model: type[M], raw: Any, what: str, source: str) -> M:
    """A reply of ``model`` (``what``: the request it answers), or :class:`ProtocolError`
    naming ``source`` (the coordinator) and the first bad field."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise ProtocolError(f"malformed {what} reply from {source}: {_first_error(e)}", "malformed") from None
