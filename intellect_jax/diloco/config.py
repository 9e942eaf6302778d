"""`[diloco]` section: outer loop, ring all-reduce and membership settings of one node."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from intellect_jax.net import codecs, robust


class DilocoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    inner_steps: PositiveInt = 100  # H: inner steps between outer steps
    outer_lr: PositiveFloat = 0.7
    outer_momentum: float = 0.9  # Nesterov
    # how pseudo-gradients are exchanged (net.quant, net.codecs): "int8", "int4", "bf16", "fp32"
    # through the ring all-reduce; "int2", "int1", "topk" and "top1" as whole contributions (net.gather),
    # with error feedback: what a node's encoding loses is added to its next contribution
    mode: Literal["int8", "int4", "bf16", "fp32", "int2", "int1", "topk", "top1"] = "int8"
    block_size: PositiveInt = 64  # int8, int4, int2, int1: elements per fp32 scale (int1: 1024 for 1.03 bits a value)
    topk: PositiveInt = 64  # topk: values kept per chunk (64 of 4096: 1.56%)
    top1_group: PositiveInt = 4  # top1: the largest of every group of this many values is sent (2..256)
    # topk: values per chunk (<= 65536; 12-bit positions up to 4096); topk and top1: values
    # sharing one pair of magnitude levels
    sparse_chunk: PositiveInt = 4096
    # error feedback (int2, int1, topk, top1): the residual a node carries into its next contribution is
    # multiplied by this each round (1: all of it; 0: none)
    feedback: float = 1.0
    # local feedback: this share (0..1) of feedback x residual stays in the node's own params
    # (each round starts from outer - feedback_local x feedback x residual, and the pseudo-gradient
    # is measured from there) instead of waiting to be sent; the contribution is unchanged.
    # 0: plain error feedback (docs/results.md: 0.5 against 0 over 10 and 60 outer steps)
    feedback_local: float = 0.0
    # where a topk/top1/int1 contribution (with its error feedback) is encoded: "device" on the
    # accelerator (XLA; only the codec's bytes cross PCIe, the residual stays on the devices),
    # "host" in numpy from the int8 pieces; "auto": device on a GPU node (diloco/device_codec.py)
    encode: Literal["auto", "device", "host"] = "auto"
    # where outer - inner is made: "device" quantizes it to int8 per shard on the accelerator
    # (only codes + scales cross PCIe; the Triton kernel on a GPU, the host codec on CPU devices);
    # "host" pulls fp32 params to the host; "auto": device on a GPU node with jax-triton
    pseudo_gradient: Literal["auto", "device", "host"] = "auto"
    # train round k+1 while round k's all-reduce and outer step run (diloco/overlap.py); None:
    # wherever it runs as asked (a single-process node, a wire format no finer than int8, whose
    # pseudo_gradient is not "host": overlapped rounds quantize each node's contribution to int8
    # on its devices). What a
    # node runs is decided by diloco.device_pg.pg_path from these settings
    overlap: bool | None = None
    # tau: the average of round k lands this many inner steps into round k+1, keeping the node's
    # progress since; default: at the first inner step after it is ready. A fixed tau makes runs
    # reproducible; the inner loop waits there if the all-reduce is not done
    overlap_delay: PositiveInt | None = None
    streams: PositiveInt = 1  # parallel TCP streams per ring link
    # "ring": contributions summed as they travel (a sender's successor sees 1/N of its own);
    # "butterfly": every member's own piece of each segment goes, signed, to that segment's owner,
    # which checks each and aggregates them with `robust` (net/butterfly.py): a bad value anywhere
    # in a contribution is evidence against its sender. Same bytes per node; int8, int4, bf16, fp32
    exchange: Literal["ring", "butterfly"] = "ring"
    # the butterfly owners' aggregator (net/robust.py): "mean", "clip" (each row to this round's
    # median norm), "trim<k>" (coordinate-wise trimmed mean), "cclip" (CenteredClip)
    robust: str = "mean"
    coordinator: str | None = None  # host:port of the run's coordinator (a node requires it)
    run_id: str = "intellect-jax"
    node_id: str | None = None  # this node's identity; default: the one node identity in `keys`
    listen: str = "127.0.0.1:0"  # ring / state-transfer listener (host:port)
    advertise: str | None = None  # address peers use to reach `listen` (default: its bound address)
    # the run's keys directory on this machine: ca.crt, crl.pem and this node's <node_id>.crt and
    # <node_id>.key, issued by the operator (python -m intellect_jax.keys); else $INTELLECT_KEYS
    keys: str | None = None
    data_rank: NonNegativeInt = 0  # this node's data shard ...
    data_ranks: PositiveInt = 1  # ... out of this many
    # data leases: each round's data is handed out by the coordinator in units of unit_steps
    # inner steps' worth of batches of the one stream every node reads (coordinator/leases.py):
    # every unit trained once, none lost with a dead node; replaces data_rank / data_ranks.
    # unit_steps default: the largest divisor of inner_steps up to 25
    leases: bool = False
    unit_steps: PositiveInt | None = None
    allreduce_deadline: PositiveFloat = 120.0  # seconds for one all-reduce before it is aborted
    max_retries: NonNegativeInt = 5  # new epochs tried for one outer step before giving up
    heartbeat_interval: PositiveFloat = 1.0
    reconnect_timeout: PositiveFloat = 120.0  # how long to wait for a restarted coordinator
    # how long a registration waits out a coordinator that does not answer (down, restarting,
    # stalled, not started yet) before the process gives up with one line naming it
    register_timeout: PositiveFloat = 600.0
    transfer_timeout: PositiveFloat = 600.0  # a joiner's wait for its state
    admission_timeout: PositiveFloat = 3600.0  # a joiner's wait for the next boundary
    init_from: str | None = None  # another node's run dir (shared storage): start from its checkpoint

    @property
    def wire_mode(self) -> str:
        """The mode as the wire names it (``topk<K>`` carries K)."""
        return {"topk": f"topk{self.topk}", "top1": f"top1of{self.top1_group}"}.get(self.mode, self.mode)

    @property
    def wire_block(self) -> int:
        """The codec's block: values per scale, or per chunk for top-k and top-1."""
        return self.sparse_chunk if self.mode in ("topk", "top1") else self.block_size

    @property
    def lease_unit(self) -> int:
        """Inner steps per leased unit of data."""
        H = self.inner_steps
        return self.unit_steps or next(u for u in range(min(25, H), 0, -1) if H % u == 0)

    @property
    def gathered(self) -> bool:
        """Contributions exchanged whole, with error feedback (``net.gather``)."""
        return codecs.gathered(self.wire_mode)

    @property
    def pow2_block(self) -> bool:
        """The device quantizer's blocks are powers of two >= 16."""
        return self.block_size >= 16 and not self.block_size & (self.block_size - 1)

    @model_validator(mode="after")
    def _check(self) -> DilocoConfig:
        if self.data_rank >= self.data_ranks:
            raise ValueError(f"data_rank ({self.data_rank}) must be < data_ranks ({self.data_ranks})")
        if self.overlap_delay is not None and self.overlap_delay > self.inner_steps:
            raise ValueError(f"overlap_delay ({self.overlap_delay}) must be <= inner_steps ({self.inner_steps})")
        if self.overlap and self.pseudo_gradient == "host":
            raise ValueError("overlap needs the device pseudo-gradient (pseudo_gradient = \"auto\" or \"device\")")
        if self.pseudo_gradient == "device" and not self.pow2_block:
            raise ValueError(f"block_size ({self.block_size}) must be a power of two >= 16 for the device "
                             "pseudo-gradient (or set pseudo_gradient = \"host\")")
        if self.mode == "topk" and not self.topk <= self.sparse_chunk <= 1 << 16:
            raise ValueError(f"topk ({self.topk}) must be <= sparse_chunk ({self.sparse_chunk}) <= 65536")
        g = self.top1_group
        if self.mode == "top1" and (g < 2 or g > 256 or g & (g - 1) or self.sparse_chunk % g):
            raise ValueError(f"top1_group ({g}) must be a power of two in 2..256 dividing sparse_chunk "
                             f"({self.sparse_chunk})")
        if self.mode == "top1" and self.sparse_chunk > 1 << 16:
            raise ValueError(f"sparse_chunk ({self.sparse_chunk}) must be <= 65536")
        if self.encode == "device" and (self.mode not in codecs.DEVICE_ENCODED or self.pseudo_gradient == "host"):
            raise ValueError(f"encode = \"device\" is for mode topk, top1 or int1 (not {self.mode}) "
                             f"on the device pseudo-gradient (pseudo_gradient {self.pseudo_gradient!r})")
        if not 0.0 <= self.feedback <= 1.0:
            raise ValueError(f"feedback must be in [0, 1], got {self.feedback}")
        if self.leases and (self.data_rank, self.data_ranks) != (0, 1):
            raise ValueError(f"leases hand out the data: drop data_rank ({self.data_rank}) and data_ranks "
                             f"({self.data_ranks})")
        if self.unit_steps is not None and self.inner_steps % self.unit_steps:
            raise ValueError(f"unit_steps ({self.unit_steps}) must divide inner_steps ({self.inner_steps})")
        if not 0.0 <= self.feedback_local <= 1.0:
            raise ValueError(f"feedback_local must be in [0, 1], got {self.feedback_local}")
        if self.feedback_local and not (self.gathered and self.feedback):
            raise ValueError(f"feedback_local is a share of the error feedback of a gathered codec (mode int2, "
                             f"int1, topk or top1, feedback > 0), not of mode {self.mode} with feedback {self.feedback}")
        if self.exchange == "butterfly" and (self.gathered or self.streams != 1):
            raise ValueError(f"exchange = \"butterfly\" takes mode int8, int4, bf16 or fp32 and streams = 1, not "
                             f"mode {self.mode} with streams {self.streams}")
        try:
            robust.check_mode(self.robust)
        except ValueError as e:
            raise ValueError(str(e)) from None
        if self.robust != "mean" and self.exchange != "butterfly":
            raise ValueError(f"robust = {self.robust!r} is applied by the butterfly's segment owners: set "
                             "exchange = \"butterfly\"")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        return self
