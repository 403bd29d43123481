"""Per-component breakdown of a decode step from a jax.profiler device trace.

    python -m bench.profile_breakdown TRACE_DIR --hlo run.hlo.txt [--hlo ...] [--steps N]
        [--window-event NAME | --window T0 T1 ...] [--top K]

Every device kernel in the trace is attributed to one component of the model: kda, mla, moe,
dense_mlp, embed, lm_head, draft, accept, commit (the `jax.named_scope`s of lingjax/model/ling.py
and lingjax/spec_decode.py), `other` (no known scope) and `idle` (window time no kernel covers).
A kernel's component comes from its HLO instruction, found in the compiled HLO text(s) the caller
saved with `dump_hlo`: an instruction's `metadata={op_name="jit(f)/.../moe/..."}` path gives the
component ('draft' wins over every scope inside it, else the innermost known name). A fusion takes
the majority component of its heavy fused instructions (dots, custom calls, reductions, gathers...),
else its root's (a fusion's own metadata is its root's), else the majority of all its instructions.
An instruction with no op_name at all (made by an XLA pass) takes the component of its nearest
scoped operands and users (through bitcasts, copies...) if they all agree.

Kernel -> instruction, in this order: the event's `hlo_op` arg (with `hlo_module` when several
modules share a name); the GPU annotation's op path arg `name` (prefixed by `prefix` if present);
the kernel name, which XLA:GPU derives from the fusion name ('.' and '-' -> '_'). Control-flow
instructions (while / conditional / call, also XLA's `command_buffer` calls) are containers, never
an answer: a GPU kernel reporting one falls through to the next rule; on CPU the container's own
event (it spans its body's ops) is dropped, so its overhead counts as idle. Kernel times are
exclusive per track (a nested event leaves its parent only the rest); each device's idle time is
the window minus the union of its kernel intervals; totals are means over devices. The window is
the spans of a named trace event (e.g. a `jax.profiler.TraceAnnotation` around each timed call),
explicit [t0, t1) ranges in the trace's microseconds, or the first to the last kernel.

Trace format. Verified on CPU (jax 0.12, this repo's tests): `jax.profiler.trace(dir)` writes
dir/plugins/profile/<run>/<host>.xplane.pb and <host>.trace.json.gz (plus perfetto_trace.json.gz with
create_perfetto_trace=True, same events), Chrome trace JSON {"traceEvents": [...]} with "M"
process_name / thread_name records and "X" events (ts, dur in microseconds); XLA ops are "X" events
on host threads (process "/host:CPU", threads "tf_XLAExecute/...") named after the instruction with
args hlo_op (instruction name of the compiled HLO text), hlo_module ("jit_f" = the text's HloModule
name), device_ordinal, run_id; control-flow thunks (while) are events that contain their body's
events; `jax.profiler.TraceAnnotation(NAME)` is an "X" event NAME on the python thread;
jax.profiler.ProfileData reads the xplane.pb with the same events and stats.
Assumed for GPU, from XLA's CUPTI collector and GPU annotation sources, to be verified on the H200:
kernels are on process "/device:GPU:<n>", one thread per stream named "Stream #<id>(Kernel,...)"
("CUPTI overhead" and derived lines such as "XLA Ops" are skipped when streams exist); the event
name is the demangled kernel name; args carry hlo_op, hlo_module, name (op path below the module's
common prefix), correlation_id, and cuda_graph_id for kernels run inside a CUDA graph. Kernels run
through XLA command buffers (lingjax/xla_env.py turns them on for the while loop) report the
command buffer, not their instruction (openxla/xprof#3070, #2544): fusion kernels are then matched
by name, library kernels (cuBLAS gemms) land in 'other'; profile with
XLA_FLAGS=--xla_gpu_enable_command_buffer= (or --no-xla-defaults) for a complete attribution.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import gzip
import json
import re
import sys
import warnings
from pathlib import Path

COMPONENTS = ("kda", "mla", "moe", "dense_mlp", "embed", "lm_head", "draft", "accept", "commit")
OTHER, IDLE = "other", "idle"
ROWS = COMPONENTS + (OTHER, IDLE)
DOMINANT = "draft"            # everything inside a 'draft' scope is the drafter's
CONTAINER_OPS = frozenset({"while", "conditional", "call", "async-start", "async-update", "async-done"})
HEAVY_OPS = frozenset({"dot", "convolution", "custom-call", "reduce", "reduce-window", "scatter", "gather",
                       "sort", "dynamic-slice", "dynamic-update-slice", "select-and-scatter"})
SKIP_VOTE_OPS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})
PLUMBING_OPS = frozenset({"bitcast", "get-tuple-element", "tuple", "copy", "reshape"})
COLLECTIVE_OPS = frozenset(f"{op}{part}" for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                                    "ragged-all-to-all", "collective-permute",
                                                    "collective-broadcast")
                           for part in ("", "-start", "-done"))
# NCCL's kernels (ncclDevKernel_AllReduce_...) and XLA's own collective kernels, by kernel name
COLLECTIVE_KERNEL = re.compile(r"(?<![a-z])(?:nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
                               r"collective)", re.IGNORECASE)
DEVICE_PROCESS = re.compile(r"^/device:(GPU|TPU):\d+")
TRACE_GLOBS = ("perfetto_trace.json.gz", "*.trace.json.gz", "*.trace.json", "*.xplane.pb")


class ProfileBreakdownError(ValueError):
    """The trace or HLO cannot be read or holds nothing to attribute."""


# ---- HLO text -> {instruction: component} ------------------------------------------------------
def component_of(op_name: str | None) -> str | None:
    """Component of a metadata op_name path: 'draft' if any path segment is 'draft', else the
    innermost segment that is a component name, else None. Segments match exactly."""
    if not op_name:
        return None
    segs = op_name.split("/")
    if DOMINANT in segs:
        return DOMINANT
    for seg in reversed(segs):
        if seg in COMPONENTS:
            return seg
    return None


_MODULE = re.compile(r"^HloModule\s+([^\s,]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?:^|[\s)}\]])([a-z][a-z0-9\-]*)\(")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_CALLEE = re.compile(r"\b(?:calls|to_apply|condition|body)=%?([^\s,{}()]+)")
_CALLEE_SET = re.compile(r"\b(?:called_computations|branch_computations)=\{([^}]*)\}")
_CLOSE = {"(": ")", "{": "}", "[": "]"}


@dataclasses.dataclass(frozen=True)
class _Instr:
    opcode: str
    named: bool               # has a non-empty op_name
    own: str | None           # component of its own op_name
    callees: tuple[str, ...]
    operands: tuple[str, ...]


def _operands(rhs: str, start: int) -> tuple[str, ...]:
    """Names in the operand list that opens at rhs[start - 1] == '('."""
    depth, piece, out = [], [], []
    for ch in rhs[start:]:
        if not depth and ch in "),":
            out.append("".join(piece))
            piece = []
            if ch == ")":
                break
            continue
        if ch in _CLOSE:
            depth.append(_CLOSE[ch])
        elif depth and ch == depth[-1]:
            depth.pop()
        piece.append(ch)
    return tuple(t.split()[-1].lstrip("%") for t in out if t.strip())


def parse_hlo(text: str):
    """(module name, {computation: [instruction names]}, {instruction: _Instr})."""
    m = _MODULE.search(text.lstrip())
    module = m.group(1) if m else ""
    comps: dict[str, list[str]] = {}
    instrs: dict[str, _Instr] = {}
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            c = _COMPUTATION.match(line)
            current = c.group(1) if c else None
            if current is not None:
                comps[current] = []
            continue
        i = _INSTRUCTION.match(line)
        if i is None or current is None:
            continue
        name, rhs = i.groups()
        op = _OPCODE.search(rhs)
        on = _OP_NAME.search(rhs)
        callees = list(_CALLEE.findall(rhs))
        for group in _CALLEE_SET.findall(rhs):
            callees += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
        instrs[name] = _Instr(op.group(1) if op else "", bool(on and on.group(1)),
                              component_of(on.group(1) if on else None), tuple(callees),
                              _operands(rhs, op.end()) if op else ())
        comps[current].append(name)
    if not instrs:
        raise ProfileBreakdownError("no HLO instructions found: pass the text of compiled.as_text()")
    return module, comps, instrs


def _vote(names, comps, instrs, seen) -> tuple[collections.Counter, collections.Counter, bool]:
    """Component counts over the instructions of computations `names`, recursively: (heavy ops,
    all ops, whether any of them has an op_name)."""
    heavy, every, named = collections.Counter(), collections.Counter(), False
    for comp in names:
        if comp in seen or comp not in comps:
            continue
        seen.add(comp)
        for n in comps[comp]:
            ins = instrs[n]
            named |= ins.named
            if ins.own is not None and ins.opcode not in SKIP_VOTE_OPS:
                every[ins.own] += 1
                if ins.opcode in HEAVY_OPS:
                    heavy[ins.own] += 1
            h, e, nm = _vote(ins.callees, comps, instrs, seen)
            heavy.update(h)
            every.update(e)
            named |= nm
    return heavy, every, named


def _pick(counter: collections.Counter, prefer: str | None) -> str | None:
    if not counter:
        return None
    best = max(counter.values())
    tied = [c for c, k in counter.items() if k == best]
    return prefer if prefer in tied else tied[0]


def _is_plumbing(ins: _Instr, comps, instrs) -> bool:
    """Data movement without compute of its own: bitcast / copy / tuple..., or a fusion of them."""
    if ins.opcode in PLUMBING_OPS:
        return True
    if ins.opcode != "fusion":
        return False
    fused = [instrs[n] for c in ins.callees if c in comps for n in comps[c]]
    return all(i.opcode in PLUMBING_OPS or i.opcode == "parameter" for i in fused)


def _is_collective(ins: _Instr, comps, instrs) -> bool:
    """A collective op, or a fusion / async wrapper whose called computations hold one."""
    if ins.opcode in COLLECTIVE_OPS:
        return True
    if ins.opcode not in ("fusion", "async-start", "async-update", "async-done"):
        return False
    return any(instrs[n].opcode in COLLECTIVE_OPS for c in ins.callees if c in comps for n in comps[c])


def _str_or_none(x) -> str | None:
    return None if x is None else str(x)


def _components(comps, instrs) -> tuple[dict[str, str | None], set[str]]:
    """({instruction: component}, names of the instructions without any op_name)."""
    direct: dict[str, str | None] = {}
    anonymous = []            # no op_name on it nor inside it: made by an XLA pass
    for name, ins in instrs.items():
        if ins.opcode in CONTAINER_OPS:
            continue
        heavy, every, named = _vote(ins.callees, comps, instrs, set())
        if ins.opcode == "fusion":   # heavy ops, else the root's (= the fusion's own), else majority
            direct[name] = _pick(heavy, ins.own) or ins.own or _pick(every, None)
        else:
            direct[name] = ins.own or _pick(heavy, None) or _pick(every, None)
        if not (ins.named or named) and ins.opcode not in SKIP_VOTE_OPS:
            anonymous.append(name)
    users = collections.defaultdict(list)
    for name, ins in instrs.items():
        for o in ins.operands:
            users[o].append(name)
    plumbing = {n for n, i in instrs.items() if _is_plumbing(i, comps, instrs)}

    def reached(start, step) -> set[str]:
        """Components of the nearest scoped instructions from start along step, through plumbing."""
        found, seen, todo = set(), set(), list(step(start))
        while todo:
            n = todo.pop()
            if n in seen or n not in instrs:
                continue
            seen.add(n)
            if direct.get(n):
                found.add(direct[n])
            elif n in plumbing:
                todo.extend(step(n))
        return found

    out = dict(direct)
    for name in anonymous:
        if direct[name] is None:
            near = reached(name, lambda n: instrs[n].operands) | reached(name, lambda n: users[n])
            if len(near) == 1:                 # only when its scoped neighbours agree
                out[name] = near.pop()
    return out, set(anonymous)


def hlo_components(text: str) -> dict[str, str | None]:
    """{instruction name: component or None} for one compiled HLO module text. Control-flow
    containers are left out; a fusion takes the majority component of its heavy fused ops (dot,
    reduce, gather...), else its root's, else that of all its ops; an instruction with no op_name
    anywhere (made by an XLA pass) takes the component of its nearest scoped operands and users
    (through bitcasts, copies...) if they all agree."""
    _, comps, instrs = parse_hlo(text)
    return _components(comps, instrs)[0]


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


class HloIndex:
    """Instruction -> component over one or more compiled HLO modules."""

    def __init__(self, hlo_texts):
        self.ops: dict[str, dict[str, str | None]] = {}          # module -> instr -> component
        self.containers: dict[str, set[str]] = {}
        self.anonymous: dict[str, set[str]] = {}                 # module -> instrs without op_name
        self.kernels: dict[str, dict[str, str | None]] = {}      # module -> sanitized -> component
        self.collectives: dict[str, set[str]] = {}               # module -> collective instrs
        for text in hlo_texts:
            module, comps, instrs = parse_hlo(text)
            ops, self.anonymous[module] = _components(comps, instrs)
            self.ops[module] = ops
            self.containers[module] = {n for n, i in instrs.items() if i.opcode in CONTAINER_OPS}
            self.collectives[module] = {n for n, i in instrs.items() if _is_collective(i, comps, instrs)}
            kern: dict[str, str | None] = {}
            clash = set()
            for n, c in ops.items():
                s = _sanitize(n)
                if s in kern and kern[s] != c:
                    clash.add(s)
                kern[s] = c
            self.kernels[module] = {s: c for s, c in kern.items() if s not in clash}

    def _find(self, table, key: str, module: str | None):
        """(found, component): the module's entry, else an entry all modules agree on."""
        if module in table:
            return (True, table[module][key]) if key in table[module] else (False, None)
        hits = {t[key] for t in table.values() if key in t}
        return (True, hits.pop()) if len(hits) == 1 else (False, None)

    def op(self, hlo_op: str, module: str | None = None):
        return self._find(self.ops, hlo_op, module)

    def kernel(self, kernel_name: str, module: str | None = None):
        return self._find(self.kernels, _sanitize(kernel_name), module)

    def _in(self, table, name: str, module: str | None) -> bool:
        mods = [module] if module in table else list(table)
        return any(name in table[m] for m in mods)

    def is_container(self, hlo_op: str, module: str | None = None) -> bool:
        return self._in(self.containers, hlo_op, module) or hlo_op.startswith("command_buffer")

    def is_collective(self, e: "Event") -> bool:
        """Whether a kernel event is a collective: its instruction, when the HLO knows it, is one
        (all-reduce, all-gather..., or an async-start / fusion wrapping one); else (no hlo_op, or
        one not in the HLO) its kernel name is NCCL's or names a collective."""
        op = e.args.get("hlo_op")
        module = _str_or_none(e.args.get("hlo_module"))
        if op is not None and (self._in(self.ops, str(op), module) or self._in(self.containers, str(op), module)):
            return self._in(self.collectives, str(op), module)      # a known instruction decides
        return bool(COLLECTIVE_KERNEL.search(e.name))

    def is_anonymous(self, hlo_op: str, module: str | None = None) -> bool:
        """No op_name on the instruction nor inside it: its component, if any, was inferred."""
        return self._in(self.anonymous, hlo_op, module)


# ---- trace -> events -----------------------------------------------------------------------------
@dataclasses.dataclass
class Event:
    name: str
    ts: float                 # microseconds
    dur: float
    process: str
    thread: str
    args: dict


def find_trace(trace_dir: str | Path) -> Path:
    """The trace file of the latest run under trace_dir (or trace_dir itself if it is a file):
    perfetto_trace.json.gz, else <host>.trace.json(.gz), else <host>.xplane.pb."""
    p = Path(trace_dir)
    if p.is_file():
        return p
    if not p.is_dir():
        raise ProfileBreakdownError(f"no trace at {p}")
    found = {f for pattern in TRACE_GLOBS for f in p.rglob(pattern)}
    if not found:
        raise ProfileBreakdownError(f"no {' / '.join(TRACE_GLOBS)} under {p}")
    run = max({f.parent for f in found}, key=lambda d: (d.name, max(f.stat().st_mtime for f in d.iterdir())))
    rank = {f: min(i for i, g in enumerate(TRACE_GLOBS) if f.match(g)) for f in found if f.parent == run}
    best = min(rank.values())
    files = sorted(f for f, r in rank.items() if r == best)
    if len(files) > 1:
        raise ProfileBreakdownError(f"several traces in {run} (one per host?): pass one of "
                                    f"{[f.name for f in files]}")
    return files[0]


def _json_events(path: Path) -> list[Event]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    raw = data["traceEvents"] if isinstance(data, dict) else data
    procs, threads = {}, {}
    for e in raw:
        if e.get("ph") == "M":
            if e.get("name") == "process_name":
                procs[e.get("pid")] = e.get("args", {}).get("name", "")
            elif e.get("name") == "thread_name":
                threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
    return [Event(e.get("name", ""), float(e["ts"]), float(e["dur"]), procs.get(e.get("pid"), str(e.get("pid"))),
                  threads.get((e.get("pid"), e.get("tid")), str(e.get("tid"))), e.get("args") or {})
            for e in raw if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _xplane_events(path: Path) -> list[Event]:
    from jax.profiler import ProfileData
    pd = ProfileData.from_file(str(path))
    with warnings.catch_warnings():     # jaxlib's stats iterator type warns about its __module__
        warnings.simplefilter("ignore", DeprecationWarning)
        return [Event(ev.name, ev.start_ns / 1e3, ev.duration_ns / 1e3, plane.name, line.name, dict(ev.stats))
                for plane in pd.planes for line in plane.lines for ev in line.events]


def load_events(trace_dir: str | Path) -> tuple[Path, list[Event]]:
    path = find_trace(trace_dir)
    if path.name.endswith(".xplane.pb"):
        return path, _xplane_events(path)
    return path, _json_events(path)


def kernel_events(events: list[Event]) -> tuple[list[Event], dict[int, str], bool]:
    """Device kernels (GPU/TPU stream lines) or, with no device plane, the XLA op events of the CPU
    backend (host events with an hlo_op arg). Returns (events, {id(event): device}, on_host)."""
    dev = [e for e in events if DEVICE_PROCESS.match(e.process)]
    threads = collections.defaultdict(set)
    for e in dev:
        threads[e.process].add(e.thread)
    keep = {}
    for proc, ts in threads.items():
        streams = {t for t in ts if t.startswith("Stream #")}
        keep[proc] = streams or ({"XLA Ops"} & ts)
    kernels = [e for e in dev if e.thread in keep[e.process]]
    if kernels:
        return kernels, {id(e): e.process for e in kernels}, False
    ops = [e for e in events if "hlo_op" in e.args]
    return ops, {id(e): f"{e.process} device {e.args.get('device_ordinal', 0)}" for e in ops}, True


# ---- intervals ---------------------------------------------------------------------------------
def _merge(intervals):
    out = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


class _Windows:
    """A union of disjoint [t0, t1) windows; the measure of an interval inside it."""

    def __init__(self, windows):
        self.w = _merge(windows)
        self.starts = [a for a, _ in self.w]
        self.length = sum(b - a for a, b in self.w)

    def touches(self, a: float, b: float) -> bool:
        """Whether [a, b] overlaps a window (for a == b: lies in one)."""
        if b > a:
            return self.inside(a, b) > 0
        i = bisect.bisect_right(self.starts, a) - 1
        return i >= 0 and a < self.w[i][1]

    def inside(self, a: float, b: float) -> float:
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        total = 0.0
        while i < len(self.w) and self.w[i][0] < b:
            total += max(0.0, min(b, self.w[i][1]) - max(a, self.w[i][0]))
            i += 1
        return total


def _exclusive(events: list[Event], win: _Windows) -> dict[int, float]:
    """{id(event): time inside the windows not covered by its direct children on its track}."""
    out = {}
    tracks = collections.defaultdict(list)
    for e in events:
        tracks[(e.process, e.thread)].append(e)
    for evs in tracks.values():
        evs.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[Event] = []
        for e in evs:
            out[id(e)] = win.inside(e.ts, e.ts + e.dur)
            while stack and e.ts >= stack[-1].ts + stack[-1].dur:
                stack.pop()
            if stack and e.ts + e.dur <= stack[-1].ts + stack[-1].dur:
                out[id(stack[-1])] -= out[id(e)]
            stack.append(e)
    return out


# ---- breakdown ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Breakdown:
    """Per-component device time of the measured window (means over devices)."""
    total_us: dict[str, float]                 # every row of ROWS
    per_step_us: dict[str, float] | None       # total / steps
    share: dict[str, float]                    # total / window
    kernels: dict[str, int]                    # kernel count (all devices)
    kernels_per_step: dict[str, float] | None  # per device and step
    window_us: float
    busy_us: float
    devices: list[str]
    steps: int | None
    unmatched: list[dict]                      # top 'other' kernels: name, hlo_op, us, count, reason
    matched_by: dict[str, int]                 # kernels found via hlo_op (inferred: from neighbours) /
                                               # the op path arg name / the kernel name / none
    notes: list[str]
    collective_us: float = 0.0                 # collective kernels' time (means over devices); these
                                               # kernels are also in their component's row
    collective_kernels: int = 0                # all devices
    trace: str = ""
    top_kernels: dict = dataclasses.field(default_factory=dict)   # component -> [{name, us, count}]:
                                               # its kernels by name (numeric suffixes dropped), most time first

    @property
    def collective_per_step_us(self) -> float | None:
        return self.collective_us / self.steps if self.steps else None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"collective_per_step_us": self.collective_per_step_us}


def _classify(e: Event, index: HloIndex):
    """(component or None, how, reason)."""
    op = e.args.get("hlo_op")
    module = e.args.get("hlo_module")
    op = str(op) if op is not None else None
    module = str(module) if module is not None else None
    reason = "no hlo_op"
    if op:
        found, comp = index.op(op, module)
        if found:
            anon = index.is_anonymous(op, module)
            return comp, "inferred" if anon and comp else "hlo_op", "no op_name" if anon else "unscoped"
        reason = "container" if index.is_container(op, module) else "not in HLO"
    path = e.args.get("name")
    if path:
        prefix = e.args.get("prefix")
        comp = component_of(f"{prefix}/{path}" if prefix else str(path))
        if comp:
            return comp, "name", ""
    found, comp = index.kernel(e.name, module)
    if found:
        return comp, "kernel", "unscoped"
    return None, "none", reason


def kernel_kind(name: str) -> str:
    """A kernel's name without XLA's numeric suffixes (loop_add_fusion_12 -> loop_add_fusion)."""
    return re.sub(r"([._]\d+)+$", "", name) or name


def breakdown_events(events: list[Event], index: HloIndex, steps: int | None = None, *,
                     windows=None, window_event: str | None = None, top: int = 8) -> Breakdown:
    """The breakdown of already loaded trace events (see `breakdown`)."""
    if steps is not None and steps < 1:
        raise ProfileBreakdownError(f"steps must be >= 1, got {steps}")
    kernels, device_of, on_host = kernel_events(events)
    if on_host:   # CPU backend: a while / call thunk spans its body's ops; its own time is not an op's
        kernels = [e for e in kernels
                   if not index.is_container(str(e.args["hlo_op"]), str(e.args.get("hlo_module")))]
    if not kernels:
        raise ProfileBreakdownError("no device kernels (GPU/TPU stream events) or XLA op events in the trace")
    if window_event is not None:
        windows = [(e.ts, e.ts + e.dur) for e in events if e.name == window_event]
        if not windows:
            raise ProfileBreakdownError(f"no trace event named {window_event!r} to use as the window")
    if windows is None:
        windows = [(min(e.ts for e in kernels), max(e.ts + e.dur for e in kernels))]
    win = _Windows(windows)
    if win.length <= 0:
        raise ProfileBreakdownError(f"empty measurement window {windows}")
    excl = _exclusive(kernels, win)
    devices = sorted(set(device_of.values()))
    n_dev = len(devices)
    total = dict.fromkeys(ROWS, 0.0)
    count = dict.fromkeys(ROWS, 0)
    matched_by = dict.fromkeys(("hlo_op", "inferred", "name", "kernel", "none"), 0)
    other, by_name = {}, {}
    cache = {}
    graph_kernels = 0
    coll_us, coll_n = 0.0, 0
    for e in kernels:
        if not win.touches(e.ts, e.ts + e.dur):
            continue
        if index.is_collective(e):
            coll_us += excl[id(e)] / n_dev
            coll_n += 1
        key = (e.name, str(e.args.get("hlo_op")), str(e.args.get("hlo_module")), str(e.args.get("name")),
               str(e.args.get("prefix")))
        if key not in cache:
            cache[key] = _classify(e, index)
        comp, how, reason = cache[key]
        matched_by[how] += 1
        graph_kernels += "cuda_graph_id" in e.args
        row = comp or OTHER
        total[row] += excl[id(e)] / n_dev
        count[row] += 1
        kinds = by_name.setdefault(row, {}).setdefault(kernel_kind(e.name), {"us": 0.0, "count": 0})
        kinds["us"] += excl[id(e)] / n_dev
        kinds["count"] += 1 / n_dev
        if row == OTHER:
            op = e.args.get("hlo_op")
            k = (e.name, str(op) if op is not None else "")
            o = other.setdefault(k, {"name": e.name, "hlo_op": k[1], "us": 0.0, "count": 0, "reason": reason})
            o["us"] += excl[id(e)] / n_dev
            o["count"] += 1
    busy = 0.0
    for dev in devices:
        merged = _merge((e.ts, e.ts + e.dur) for e in kernels if device_of[id(e)] == dev)
        busy += sum(win.inside(a, b) for a, b in merged) / n_dev
    total[IDLE] = win.length - busy
    notes = ["CPU backend: XLA op events of host threads; control-flow thunks count as idle"] if on_host else []
    if graph_kernels:
        notes.append(f"{graph_kernels} kernels ran inside CUDA graphs (XLA command buffers): attributed by "
                     "kernel name only, library kernels go to 'other'; rerun with "
                     "XLA_FLAGS=--xla_gpu_enable_command_buffer= for a complete attribution")
    if matched_by["none"] == sum(matched_by.values()):
        notes.append("no kernel matched the HLO: is the HLO text from the profiled executable?")
    per_step = {k: v / steps for k, v in total.items()} if steps else None
    kps = {k: v / steps / n_dev for k, v in count.items()} if steps else None
    unmatched = sorted(other.values(), key=lambda o: -o["us"])[:top]
    top_kernels = {row: [{"name": n, **v} for n, v in sorted(kinds.items(), key=lambda kv: -kv[1]["us"])[:top]]
                   for row, kinds in by_name.items()}
    return Breakdown(total, per_step, {k: v / win.length for k, v in total.items()}, count, kps,
                     win.length, busy, devices, steps, unmatched, matched_by, notes, coll_us, coll_n,
                     top_kernels=top_kernels)


def breakdown(trace_dir, hlo_texts: list[str], steps: int | None = None, *, windows=None,
              window_event: str | None = None, top: int = 8) -> Breakdown:
    """Per-component breakdown of the device time in a jax.profiler trace.

    trace_dir: the jax.profiler.trace log dir (latest run), a run folder, or one trace file
    (.trace.json.gz / perfetto_trace.json.gz / .xplane.pb). hlo_texts: compiled HLO text of every
    profiled executable (see dump_hlo). steps: decode steps in the window (for per-step numbers).
    windows: [(t0, t1)] in the trace's microseconds, or window_event: the name of trace events (e.g.
    a jax.profiler.TraceAnnotation around each timed call) whose spans form the window; default:
    first kernel start to last kernel end. top: how many unmatched kernel names to list.
    """
    if not hlo_texts:
        raise ProfileBreakdownError("at least one compiled HLO text is needed (dump_hlo)")
    path, events = load_events(trace_dir)
    b = breakdown_events(events, HloIndex(hlo_texts), steps, windows=windows, window_event=window_event, top=top)
    b.trace = str(path)
    return b


def dump_hlo(compiled, path: str | Path) -> Path:
    """Write compiled HLO text (a jax Compiled, anything with as_text(), or a str) to path."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    if not text:
        raise ProfileBreakdownError("the compiled object has no HLO text")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def format_table(b: Breakdown) -> str:
    per = b.per_step_us is not None
    head = f"{'component':12s} {'total ms':>10s} {'share':>7s}"
    head += f" {'us/step':>10s} {'kernels/step':>13s}" if per else f" {'kernels':>9s}"
    lines = [head]
    for r in ROWS:
        line = f"{r:12s} {b.total_us[r] / 1e3:10.3f} {b.share[r] * 100:6.1f}%"
        if per:
            kps = "" if r == IDLE else f"{b.kernels_per_step[r]:.1f}"
            line += f" {b.per_step_us[r]:10.1f} {kps:>13s}"
        else:
            line += f" {'' if r == IDLE else b.kernels[r]:>9}"
        lines.append(line)
    lines.append(f"window {b.window_us / 1e3:.3f} ms, busy {b.busy_us / 1e3:.3f} ms on {len(b.devices)} "
                 f"device(s)" + (f", {b.steps} steps" if b.steps else "") + "; kernels matched by "
                 + ", ".join(f"{k} {v}" for k, v in b.matched_by.items()))
    if b.collective_kernels:
        per_step = (f", {b.collective_per_step_us:.1f} us/step, "
                    f"{b.collective_kernels / b.steps / len(b.devices):.1f} kernels/step per device" if b.steps else "")
        lines.append(f"collectives (inside the rows above): {b.collective_us / 1e3:.3f} ms "
                     f"({b.collective_us / b.window_us * 100:.1f}% of the window){per_step}")
    if b.unmatched:
        lines.append("top 'other' kernels (us, count, reason):")
        for o in b.unmatched:
            op = f" [hlo_op {o['hlo_op']}]" if o["hlo_op"] and o["hlo_op"] != o["name"] else ""
            lines.append(f"  {o['us']:12.1f} {o['count']:7d}  {o['name'][:90]}{op} ({o['reason']})")
    if b.top_kernels:
        steps = b.steps or 1
        unit = "us/step, count/step" if b.steps else "us, count"
        lines.append(f"kernels by name per component ({unit}, most time first):")
        for row in ROWS:
            for k in b.top_kernels.get(row, []):
                lines.append(f"  {row:10s} {k['us'] / steps:10.1f} {k['count'] / steps:8.1f}  {k['name'][:90]}")
    lines += [f"note: {n}" for n in b.notes]
    return "\n".join(lines)


def main(argv=None) -> Breakdown:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_breakdown", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir", help="jax.profiler.trace log dir, run folder or trace file")
    ap.add_argument("--hlo", action="append", required=True, metavar="FILE",
                    help="compiled HLO text of a profiled executable (repeatable)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps in the window (per-step numbers)")
    ap.add_argument("--window-event", default=None, metavar="NAME",
                    help="trace events named NAME (e.g. a TraceAnnotation) delimit the window")
    ap.add_argument("--window", nargs=2, type=float, action="append", metavar=("T0", "T1"),
                    help="window in the trace's microseconds (repeatable; default: first to last kernel)")
    ap.add_argument("--top", type=int, default=8, help="unmatched kernel names to list")
    a = ap.parse_args(argv)
    try:
        texts = [Path(f).read_text() for f in a.hlo]
        b = breakdown(a.trace_dir, texts, a.steps, windows=a.window, window_event=a.window_event, top=a.top)
    except (OSError, ProfileBreakdownError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    print(format_table(b))
    print(json.dumps(b.as_dict()))
    return b


if __name__ == "__main__":
    main()
