"""What an XLA:GPU executable launches, read from its thunk sequence: kernels per loop iteration by
kind, command buffers (CUDA graphs) and what stays outside them, bytes copied per iteration, and
the JAX operations the kernels come from.

XLA:GPU runs a program as a tree of thunks: kernels, copies, GEMM library calls, and containers
(`kWhile` with a condition and a body, `kConditional`, `kSequential`, and `kCommandBuffer`, a run
of thunks recorded once and replayed as one CUDA graph). An XLA dump (`--xla_dump_to`) writes the
tree twice per module: `*thunk_sequence.txt` as emitted and `*thunk_sequence_after_thunk_passes.txt`
after the passes that form command buffers, which is what runs (it is only written when a pass
changed something). Command buffers show only there: the optimized HLO never names them.

    from thunks import profile_module
    report = profile_module("/tmp/dump", "module_0042.jit_decode")

One line per thunk, nested by indentation; a `kWhile`'s thunks are grouped under `condition:` and
`body:` labels (which XLA prints at indentations of their own, so the labels are attached to the
nearest open loop):

    000: kCommandBuffer [source | sink]
        003: kWhile [prev=002 (1) | sink]
    condition:
            004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] ...
          body:
            006: kCustomKernel [...] gemm_fusion_dot_general_0 grid: [16, 1, 1] ...
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re

THUNK = re.compile(r"^(\s*)(\d+): (k\w+)\s*\[[^\]]*\]\s*(\S*)")
LABEL = re.compile(r"^\s*([A-Za-z][\w ]*?):\s*$")
# containers: they launch nothing themselves
CONTAINERS = {"kSequential", "kWhile", "kConditional", "kCommandBuffer"}
# thunks that go back to the host mid-program (a command buffer cannot hold them)
HOST = {"kHostSend", "kHostRecv", "kHostSendDone", "kHostRecvDone", "kInfeed", "kOutfeed", "kSend", "kRecv"}
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}


@dataclasses.dataclass
class Thunk:
    id: int
    kind: str
    name: str  # the HLO instruction's name where the line gives one ("." printed as "_")
    children: dict[str, list[Thunk]] = dataclasses.field(default_factory=dict)
    label: str = ""  # the label new children go under (a loop's condition / body)

    def add(self, child: Thunk) -> None:
        self.children.setdefault(self.label or "seq", []).append(child)

    def all_children(self) -> list[Thunk]:
        return [c for group in self.children.values() for c in group]


def parse(text: str) -> Thunk:
    """The thunk tree of one `*thunk_sequence*.txt` file (its root a kSequential of id -1)."""
    root = Thunk(-1, "kSequential", "")
    stack: list[tuple[int, Thunk]] = [(-1, root)]
    pending = ""
    for line in text.splitlines():
        m = THUNK.match(line)
        if m is None:
            lab = LABEL.match(line)
            if lab:
                pending = lab.group(1).strip()
            continue
        indent = len(m.group(1))
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        if pending:
            parent.label, pending = pending, ""
        node = Thunk(int(m.group(2)), m.group(3), m.group(4))
        parent.add(node)
        stack.append((indent, node))
    return root


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class Hlo:
    """What the optimized HLO says of each instruction: shape (for copies), JAX op name and the
    source line that made it."""

    shapes: dict[str, str]
    op_names: dict[str, str]
    annotations: dict[int, str]  # thunk id -> HLO instruction (thunk_metadata.txt)
    frames: dict[str, str] = dataclasses.field(default_factory=dict)  # instruction -> "file:line function"

    def source(self, t: Thunk) -> str:
        """The innermost Python line (relative to the repository) the thunk's instruction came from."""
        name = self.instruction(t)
        return self.frames.get(name) or self.frames.get(_printed(name)) or "?"

    def instruction(self, t: Thunk) -> str:
        return self.annotations.get(t.id) or t.name

    def op_name(self, t: Thunk) -> str:
        name = self.instruction(t)
        # the sequence prints "gemm_fusion_dot_general_0" for the instruction "gemm_fusion_dot_general.0"
        return self.op_names.get(name) or self.op_names.get(_printed(name)) or name

    def bytes_of(self, t: Thunk) -> int:
        shape = self.shapes.get(self.instruction(t), "")
        total = 0
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * DTYPE_BYTES.get(dt, 4)
        return total


def _printed(name: str) -> str:
    """An HLO instruction's name as a thunk sequence prints it."""
    return re.sub(r"[.\-]", "_", name)


INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+[\w\-]+\(")
OP_NAME = re.compile(r'op_name="([^"]*)"')


FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
TABLE_ROW = re.compile(r'^(\d+) (?:"(.*)"|\{(.*)\})$')


def _source_lines(after_opt: str) -> dict[int, str]:
    """stack frame id -> "file:line function", from the tables an optimized HLO dump starts with
    (FileNames, FunctionNames, FileLocations, StackFrames)."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in after_opt.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        m = TABLE_ROW.match(line) if current is not None else None
        if m is None:
            if line.startswith(("HloModule", "ENTRY", "%")):
                current = None
            continue
        current[int(m.group(1))] = m.group(2) if m.group(2) is not None else m.group(3)
    files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    field = lambda text, key: int(re.search(rf"{key}=(\d+)", text).group(1))
    out = {}
    for frame, text in tables.get("StackFrames", {}).items():
        loc = tables.get("FileLocations", {}).get(field(text, "file_location_id"), "")
        if not loc:
            continue
        path = files.get(field(loc, "file_name_id"), "?")
        rel = os.path.relpath(path, REPO) if path.startswith(REPO) else path
        out[frame] = f"{rel}:{field(loc, 'line')} {funcs.get(field(loc, 'function_name_id'), '?')}"
    return out


def read_hlo(after_opt: str, metadata: str) -> Hlo:
    shapes, op_names, frames = {}, {}, {}
    lines = _source_lines(after_opt)
    for line in after_opt.splitlines():
        m = INSTR.match(line)
        if m:
            shapes[m.group(1)] = m.group(2)
            o = OP_NAME.search(line)
            if o:
                op_names[m.group(1)] = op_names[_printed(m.group(1))] = o.group(1)
            f = FRAME_ID.search(line)
            if f and int(f.group(1)) in lines:
                frames[m.group(1)] = frames[_printed(m.group(1))] = lines[int(f.group(1))]
    ann = {}
    for block in metadata.split("thunk_metadata {")[1:]:
        a = re.search(r'profile_annotation: "([^"]*)"', block)
        i = re.search(r"thunk_id: (\d+)", block)
        if a and i:
            ann[int(i.group(1))] = a.group(1)
    return Hlo(shapes, op_names, ann, frames)


def short_op(op_name: str) -> str:
    """A JAX op name without the program's prefix and the loop/call scaffolding: "jit(decode)/while/
    body/closed_call/jit(rms_norm)/mul" -> "rms_norm/mul"."""
    parts = [p for p in op_name.split("/")[1:] if p not in ("while", "body", "cond", "closed_call", "checkpoint")]
    parts = [p[4:-1] if p.startswith("jit(") and p.endswith(")") else p for p in parts]
    return "/".join(parts[-3:]) or op_name


@dataclasses.dataclass
class Loop:
    path: str  # e.g. "while 12" or "while 12 > while 40" (a loop inside another's body)
    kernels: int  # launches per iteration (condition + body, not counting loops nested inside)
    by_kind: dict[str, int]
    copy_bytes: int  # bytes written by kCopy per iteration
    captured: bool  # inside a command buffer (one CUDA graph replays the whole loop)
    nested: int  # loops inside its body
    ops: collections.Counter  # kernels by JAX op name
    sources: collections.Counter  # kernels by the Python line that made them


@dataclasses.dataclass
class Report:
    outside: int  # launches outside every loop
    top_level: int  # thunks at the top level (command buffers count one)
    command_buffers: int
    loops: list[Loop]
    breakers: list[str]  # top-level thunks no command buffer holds, where some loop is not captured
    host: int  # thunks that go back to the host

    def main_loop(self) -> Loop | None:
        """The loop that does the work (most kernels per iteration)."""
        return max(self.loops, key=lambda lp: lp.kernels, default=None)

    def as_dict(self) -> dict:
        loops = [
            {**vars(lp), "ops": dict(lp.ops.most_common(12)), "sources": dict(lp.sources.most_common(40))}
            for lp in self.loops
        ]
        return {**vars(self), "loops": loops}


@dataclasses.dataclass
class _Tally:
    kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    sources: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def _leaves(nodes: list[Thunk], hlo: Hlo, tally: _Tally) -> tuple[int, int]:
    """(launches, copied bytes) of `nodes`, descending into command buffers and sequences but not
    into loops (counted per iteration on their own) or conditionals' branches (the largest); each
    launch tallied by kind, JAX op name and source line."""
    n = b = 0
    for t in nodes:
        if t.kind == "kWhile":
            continue
        if t.kind == "kConditional":
            best = max((_leaves(g, hlo, _Tally()) for g in t.children.values()), default=(0, 0))
            n, b = n + best[0], b + best[1]
            continue
        if t.kind in CONTAINERS:
            dn, db = _leaves(t.all_children(), hlo, tally)
            n, b = n + dn, b + db
            continue
        n += 1
        tally.kinds[t.kind] += 1
        tally.ops[short_op(hlo.op_name(t))] += 1
        tally.sources[hlo.source(t)] += 1
        if t.kind == "kCopy":
            b += hlo.bytes_of(t)
    return n, b


def _loops(nodes: list[Thunk], hlo: Hlo, path: str, captured: bool, out: list[Loop]) -> None:
    for t in nodes:
        if t.kind == "kWhile":
            tally = _Tally()
            here = t.all_children()
            n, b = _leaves(here, hlo, tally)
            me = f"{path} > while {t.id}" if path else f"while {t.id}"
            inner: list[Loop] = []
            _loops(here, hlo, me, captured, inner)
            nested = sum(1 for lp in inner if lp.path.count(">") == me.count(">") + 1)
            out.append(Loop(me, n, dict(tally.kinds), b, captured, nested, tally.ops, tally.sources))
            out.extend(inner)
        elif t.kind in CONTAINERS:
            _loops(t.all_children(), hlo, path, captured or t.kind == "kCommandBuffer", out)


def _count_host(node: Thunk) -> int:
    return sum((c.kind in HOST) + _count_host(c) for c in node.all_children())


def profile(sequence: str, after_opt: str = "", metadata: str = "") -> Report:
    """The report of one module from its thunk sequence text (the after-passes one where there is one),
    its optimized HLO and its thunk metadata (both optional: names and copy sizes come from them)."""
    root = parse(sequence)
    hlo = read_hlo(after_opt, metadata)
    top = root.all_children()
    if len(top) == 1 and top[0].kind == "kSequential":
        top = top[0].all_children()
    outside, _ = _leaves(top, hlo, _Tally())
    loops: list[Loop] = []
    _loops(top, hlo, "", False, loops)
    breakers = []
    if any(not lp.captured for lp in loops):
        breakers = [f"{t.kind} {t.name}".strip() for t in top if t.kind != "kCommandBuffer"]
    return Report(
        outside=outside,
        top_level=len(top),
        command_buffers=sum(1 for t in top if t.kind == "kCommandBuffer"),
        loops=loops,
        breakers=breakers,
        host=_count_host(root),
    )


def module_files(dump: str) -> dict[str, str]:
    """module name ("module_0042.jit_decode") -> its thunk sequence file in `dump`, after the passes
    where XLA wrote that one."""
    out: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(dump, "*.thunk_sequence*.txt"))):
        base = os.path.basename(path)
        name = base.split(".thunk_sequence")[0]
        if name not in out or "after_thunk_passes" in base:
            out[name] = path
    return out


def profile_module(dump: str, module: str) -> Report:
    seq = module_files(dump)[module]
    read = lambda pattern: next((open(p).read() for p in glob.glob(os.path.join(dump, module + pattern))), "")
    return profile(open(seq).read(), read(".*gpu_after_optimizations.txt"), read(".thunk_metadata.txt"))
