"""What a compiled program does, read from its optimized HLO text: the attention kernel it
calls, its collectives, and whether the scheduler overlaps each asynchronous one with compute.

The text is XLA's after every pass (``compiled.as_text()``); a scheduled module lists each
computation's instructions in their run order, so an asynchronous collective overlaps compute
when a fusion, a matrix product or a custom call (or a loop, call or conditional holding one)
sits between its ``-start`` and its ``-done``. A start marked ``"is_sync":true`` is synchronous.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

CUDNN_FWD, CUDNN_BWD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_COMPUTE = ("fusion", "custom-call", "dot", "convolution")
# `%name = <shape> <opcode>(` where the shape may be a tuple with spaces: the opcode is the
# last identifier before the first "(" that follows the shape
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"(?:^|[\s}\]])(?P<op>[a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"calls=%(?P<callee>[\w.\-]+)")
# every computation an instruction runs: a while's body, a call's, a conditional's branches
_CALLED = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%(?P<c>[\w.\-]+)"
                     r"|branch_computations=\{(?P<b>[^}]*)\}")


@dataclass
class Collectives:
    count: Counter = field(default_factory=Counter)  # kind -> instructions (async pairs count once)
    asynchronous: Counter = field(default_factory=Counter)  # kind -> those issued as start/done
    overlapped: Counter = field(default_factory=Counter)  # kind -> async ones with compute inside

    def summary(self) -> dict[str, dict[str, int]]:
        return {k: {"count": self.count[k], "async": self.asynchronous[k], "overlapped": self.overlapped[k]}
                for k in COLLECTIVES if self.count[k]}


def _computations(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """computation name -> its instructions as (name, opcode, text after the shape), in order."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    cur: list[tuple[str, str, str]] | None = None
    for line in text.splitlines():
        s = line.strip()
        if s.endswith("{") and not s.startswith("%") or s.startswith(("ENTRY ", "%")) and s.endswith("{"):
            head = s.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
            cur = comps.setdefault(head, [])
            continue
        if s == "}":
            cur = None
            continue
        m = _INSTR.match(line)
        if cur is None or not m:
            continue
        after = _strip_shape(m["rest"])  # the opcode, operands and attributes
        op = _OPCODE.search(after)
        cur.append((m["name"], op["op"] if op else "", after))
    return comps


def _strip_shape(rest: str) -> str:
    """The instruction after its shape (a tuple shape is parenthesised and may hold spaces)."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                return rest[i + 1:]
    return rest.split(" ", 1)[1] if " " in rest else rest


def _kind(op: str, line: str, comps: dict[str, list]) -> str | None:
    """The collective an instruction is (or starts/ends), else None."""
    base = op.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVES:
        return base
    if op in ("async-start", "async-done"):  # a wrapped collective: look inside the callee
        m = _CALLS.search(line)
        for _, inner, _ in comps.get(m["callee"], []) if m else []:
            if inner in COLLECTIVES:
                return inner
    return None


def _computes(op: str, line: str, comps: dict[str, list], seen: dict[str, bool]) -> bool:
    """Whether an instruction is compute: a fusion, matmul or custom call, or a while, call or
    conditional whose computations hold one (a scanned layer loop between a start and its done)."""
    if op in _COMPUTE:
        return True
    if op not in ("while", "call", "conditional"):
        return False
    for m in _CALLED.finditer(line):
        for name in [m["c"]] if m["c"] else [b.strip().lstrip("%") for b in m["b"].split(",")]:
            if name not in seen:
                seen[name] = False  # a cycle cannot make itself compute
                seen[name] = any(_computes(o, ln, comps, seen) for _, o, ln in comps.get(name, []))
            if seen[name]:
                return True
    return False


def collectives(text: str) -> Collectives:
    comps = _computations(text)
    seen: dict[str, bool] = {}
    wrapped = {m["callee"] for instrs in comps.values() for _, op, line in instrs
               if op == "async-start" and (m := _CALLS.search(line))}  # their collective is the start's
    out = Collectives()
    for comp, instrs in comps.items():
        if comp in wrapped:
            continue
        opened: dict[str, tuple[str, int]] = {}  # start name -> (kind, compute seen since)
        for name, op, line in instrs:
            if op.endswith("-done"):
                src = re.search(r"\(%(?P<s>[\w.\-]+)", line)
                started = opened.pop(src["s"], None) if src else None
                if started and started[1]:
                    out.overlapped[started[0]] += 1
                continue
            kind = _kind(op, line, comps)
            if kind:
                out.count[kind] += 1
                # XLA:GPU keeps start/done for a collective it made synchronous ("is_sync":true)
                if op.endswith("-start") and '"is_sync":true' not in line:
                    opened[name] = (kind, 0)
                    out.asynchronous[kind] += 1
            elif _computes(op, line, comps, seen):
                opened = {k: (kd, n + 1) for k, (kd, n) in opened.items()}
    return out


def attention(text: str) -> str:
    """"cudnn" when the program calls cuDNN's fused attention, else "xla"."""
    return "cudnn" if CUDNN_FWD in text or CUDNN_BWD in text else "xla"


def cudnn_calls(text: str) -> dict[str, int]:
    return {"forward": text.count(f'custom_call_target="{CUDNN_FWD}"'),
            "backward": text.count(f'custom_call_target="{CUDNN_BWD}"')}
