"""Step graphs: small forward steps replayed from a traced op graph, without
the model's Python.

What it replaces: on CUDA the host captures small decode steps as CUDA graphs
(`vllm.compilation.cuda_graph.CUDAGraphWrapper`); the host's CPU runner
(`vllm.v1.worker.cpu_model_runner.CPUModelRunner`) has no capture and, in
eager mode, runs the model's Python every step: on a 2-core AVX2 VM a
SmolLM2-135M decode step makes ~8,100 Python calls and 365 module calls around
its ~360 kernel calls, as long as the linears themselves (docs/performance.md).

Here the first forward of each small token count is recorded (a torch
dispatch mode sees every op the step runs, with its arguments) and turned into
one straight-line Python function of torch ops: our kernels, the host's opaque
attention ops, views and allocations, specialised to that count's shapes.
Later forwards of that count run that function instead of the modules.
Steps of more tokens than that (prefills, chunked-prefill batches) share one
graph for every count: two such steps of different counts are recorded with
their integer arguments left open, each that differs between them must be
slope * T + offset in the step's token count T (a size in tokens), and the
graph is checked against eager at a third count (`_generalize`); it keeps no
buffers (it allocates as the model does). The attention ops stay opaque, as
in the host's piecewise CUDA graphs: they read the step's metadata from the
forward context when they run, so one graph serves every step of its token
count. A `lower` hook may record a direct call in an op's place
(`cpu_backend.attention.step_ops`: the host's attention ops become calls of
our attention kernels). Recording costs about one step plus
~20 us per op (make_fx, which builds fake tensors for every node, took 2-3 s).

As in a CUDA graph's memory pool, a step's scratch activations live in
buffers the graph allocates once (`_Recorder._plan_buffers`): each `empty`,
and each result of our linears (recorded as their `..._out` forms), that only
aten's and our ops read and that the step does not return, reads a buffer
shared with the allocations whose uses do not overlap; views and splits of a
buffer become constants. The buffers stay for good: `buffer_budget` (what the
KV sizing reserved for them) bounds their sum, counts whose graph would not
fit run eagerly. An in-place norm or SiLU-and-mul right before one
of our linears (float, int4/int8 weights, W8A8) that reads what it wrote is
recorded with it as one composite call (`_COMPOSITES`,
csrc/prologue_linear.cpp). A SmolLM2-135M decode step replays
185 calls instead of 544 (docs/performance.md).

Tracing once is sound where the host's torch.compile is: it traces the same
models once for all steps (`support_torch_compile`, guards dropped), so only
models with such a module are captured. The rest stays eager: parallel ranks
(tensor, pipeline, data), LoRA, speculative decoding, inputs given as
embeddings, stateful (non-attention) layers such as Mamba, and compiled mode.
A step whose Python reads tensor values (`.item()`, a boolean mask) is not
recorded. Each new graph is replayed once on its step's inputs and must match
a fresh eager run of them bit for bit, else (or if recording fails) the runner
goes back to eager for good, with a warning.
"""

from __future__ import annotations

import math
import re
import time
import types
import weakref
from collections import Counter
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")

# Token counts up to this are captured: a batch-1 decode step's Python costs
# about as much as its kernels; a 32- or 64-token step (batched decode) still
# spends 5-10% of its time in the eager model's Python (SmolLM2-135M on the
# 2-core VM, docs/performance.md); larger steps spend it in GEMMs.
MAX_TOKENS = 64
# Counts up to this are captured when first seen; larger ones at their
# CAPTURE_AT_SIGHTING-th step, so that a count the traffic makes a few times
# only (a prompt's prefill, a draining batch) costs no capture (about 1.5
# steps' time, the gain 5-7% per replay) and no graph (~35 KB per token of
# buffers for Qwen2.5-0.5B).
CAPTURE_AT_FIRST = 16
CAPTURE_AT_SIGHTING = 4
# Larger steps share one graph for every token count (StepGraphs._generic_step);
# pairs of recordings whose ops differ are tried this many times.
GENERIC_ATTEMPTS = 3

# lower(op, args, kwargs) -> (call, args, name for reports) to record in the
# op's place (after the op ran), or None to record the op itself. The call
# must do what the op did, given the same arguments in a later step.
Lowering = Callable[[object, tuple, dict], "tuple[Callable, tuple, str] | None"]


class StepGraph:
    """A recorded step: `run(input_ids, positions)` replays its ops."""

    def __init__(self, source: str, constants: dict, op_counts: Counter[str],
                 buffer_bytes: int = 0):
        self.source = source
        self.op_counts = op_counts  # "namespace::op" -> calls per replay
        self.buffer_bytes = buffer_bytes  # of the activation buffers it owns
        self.num_ops = sum(op_counts.values())
        namespace = dict(constants)
        exec(compile(source, "<cpu_backend step graph>", "exec"), namespace)  # noqa: S102
        self.run = namespace["step"]

    @classmethod
    def record(cls, forward: Callable, input_ids: torch.Tensor, positions: torch.Tensor,
               lower: Lowering | None = None):
        """Run `forward` once for real; returns its output and the graph of it."""
        output, recorder = _record(forward, input_ids, positions, lower)
        source = recorder.source(output)
        return output, cls(source, recorder.constants, recorder.op_counts, recorder.buffer_bytes)


class _Sample:
    """A step recorded with its integer arguments as placeholders, for a graph
    of every token count (`_generalize`)."""

    def __init__(self, count: int, recorder: "_Recorder", output):
        self.count = count
        self.template = recorder.source(output)
        self.ints = recorder.ints
        self.constants = recorder.constants
        self.op_counts = recorder.op_counts

    @classmethod
    def record(cls, forward: Callable, input_ids: torch.Tensor, positions: torch.Tensor,
               lower: Lowering | None = None):
        """Run `forward` once for real; returns its output and the sample."""
        output, recorder = _record(forward, input_ids, positions, lower, symbolic_ints=True)
        return output, cls(input_ids.shape[0], recorder, output)


def _record(forward: Callable, input_ids: torch.Tensor, positions: torch.Tensor,
            lower: Lowering | None, symbolic_ints: bool = False) -> tuple[object, "_Recorder"]:
    """Run `forward` once for real under a recorder; its output and the recorder."""
    recorder = _Recorder({id(input_ids): "input_ids", id(positions): "positions"}, lower,
                         symbolic_ints)
    with recorder:
        output = forward(input_ids=input_ids, positions=positions)
    return output, recorder


_INT = "__int{}__"
_INT_PLACEHOLDER = re.compile(r"__int(\d+)__")


def _generalize(a: _Sample, b: _Sample) -> StepGraph | None:
    """One graph for any token count T, from steps recorded at counts a != b:
    they must run the same ops on the same constants, and each integer
    argument that differs between them must be an exact slope * T + offset (a
    size in tokens); None otherwise."""
    if (a.template != b.template or len(a.ints) != len(b.ints)
            or a.constants.keys() != b.constants.keys()
            or not all(_same_constant(a.constants[k], b.constants[k]) for k in a.constants)):
        return None
    values = []
    for x, y in zip(a.ints, b.ints):
        if x == y:
            values.append(repr(x))
            continue
        slope, rest = divmod(y - x, b.count - a.count)
        if rest:
            return None
        values.append(f"({slope} * T + {x - slope * a.count})")
    header, body = _INT_PLACEHOLDER.sub(lambda m: values[int(m.group(1))], a.template).split("\n", 1)
    return StepGraph(f"{header}\n    T = input_ids.shape[0]\n{body}", a.constants, a.op_counts)


def _same_constant(a, b) -> bool:
    """Whether two recordings' constants are interchangeable: the same object,
    a view of the same memory, or a function of the same code over such
    values (a lowered op's closure)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
                and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())
    if isinstance(a, types.FunctionType) or isinstance(b, types.FunctionType):
        if not (isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType)
                and a.__code__ is b.__code__):
            return False
        cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
        return len(cells_a) == len(cells_b) and all(
            _same_constant(x.cell_contents, y.cell_contents) for x, y in zip(cells_a, cells_b))
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same_constant(x, y) for x, y in zip(a, b)))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - not comparable: not the same
        return False


class _Recorder(TorchDispatchMode):
    """Writes each dispatched op as a line of Python; tensors the step did not
    make (weights, caches, buffers) become constants, referenced, not copied."""

    def __init__(self, inputs: dict[int, str], lower: Lowering | None = None,
                 symbolic_ints: bool = False):
        super().__init__()
        self.lower = lower
        # Integer arguments as placeholders (`_INT.format(index)`), their
        # values in `ints`, for a graph of any token count (`_generalize`);
        # such a step keeps no buffers (their sizes would depend on the count).
        self.symbolic_ints = symbolic_ints
        self.ints: list[int] = []
        self.names = dict(inputs)   # id(tensor) -> the variable holding it
        self.constant_names: dict[int, str] = {}
        self.alive: list = []       # every tensor seen, so no id is reused
        self.constants: dict[str, object] = {}
        self.lines: list[tuple[str, list[str]]] = []   # (assignment, names read)
        self.line_ops: list[str] = []                     # each line's op name
        self.storages: dict[str, set[int]] = {}           # variable -> its tensors' storages
        self.fresh: dict[str, torch.Tensor] = {}          # variable -> an `empty` it holds
        self.views: dict[str, object] = {}                # variable -> the view(s) it holds
        self.constant_lines: set[int] = set()             # lines that now read a constant
        self.op_counts: Counter[str] = Counter()
        self.buffer_bytes = 0  # of the buffers _plan_buffers made
        self.prologue: tuple | None = None  # the last line, if a prologue op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _tensors_or_none(out):
            # A value leaving torch for Python (.item(), bool(tensor)) would be
            # baked into the graph: such a step is not captured.
            raise DataDependentStep(f"{func} returns {type(out).__name__} to Python")
        if _shape_depends_on_values(func, args):
            # nonzero, masked_select...: later ops would keep this step's sizes.
            raise DataDependentStep(f"the shape {func} returns depends on tensor values")
        if (getattr(func, "is_view", False) and isinstance(out, torch.Tensor)
                and not self._reads_step_values((args, kwargs))):
            # A view of a weight (detach, transpose): the same view every step.
            return out
        if _same_view(func, args, out) and id(args[0]) in self.names:
            # view(x, x.shape), detach(x)...: x itself serves its readers, one
            # op fewer per replay (a quarter of a decode step's ops).
            self.names[id(out)] = self.names[id(args[0])]
            self._track(out)
            return out
        lowered = self.lower(func, args, kwargs) if self.lower is not None else None
        if lowered is not None:
            func, args, op_name = lowered
            kwargs = {}
        else:
            op_name = getattr(func, "name", lambda: str(func))()
            into = _OUT_FORMS.get(op_name)
            if (into is not None and isinstance(out, torch.Tensor) and out.is_contiguous()
                    and out.numel() > 0):
                return self._record_into(into, op_name, func, out, args, kwargs)
        read: list[str] = []
        exprs = [self._expr(a, read) for a in args]
        call = ", ".join(exprs + [f"{k}={self._expr(v, read)}" for k, v in kwargs.items()])
        target = f"v{len(self.lines)}"
        callee = _callee(func)
        self.lines.append((f"{target} = {self._constant(callee)}({call})", read))
        self.line_ops.append(op_name)
        self.prologue = (op_name, exprs, read) if op_name in _PROLOGUES and not kwargs else None
        self.op_counts[op_name] += 1
        self._track(out)
        self.storages[target] = _storages(out)
        if (func is torch.ops.aten.empty.memory_format and lowered is None
                and isinstance(out, torch.Tensor) and out.numel() > 0 and not self.symbolic_ints):
            self.fresh[target] = out
        if (lowered is None and getattr(func, "is_view", False) and len(read) == 1
                and not self.symbolic_ints):
            self.views[target] = out
        if isinstance(out, torch.Tensor):
            self.names[id(out)] = target
        elif isinstance(out, (tuple, list)):
            for index, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    self.names[id(item)] = f"{target}[{index}]"
        return out

    def _record_into(self, into: _OutForm, op_name: str, func, out: torch.Tensor, args: tuple,
                     kwargs: dict) -> torch.Tensor:
        """Records an op that allocates its result as an `empty` of the result's
        shape and a call of the op's form that writes into it, so the result
        can live in a preallocated buffer (`_plan_buffers`)."""
        prologue = self._take_prologue(into, func, args)
        buffer = f"v{len(self.lines)}"
        shape = self._expr(list(out.shape), [])
        self.lines.append((f"{buffer} = {self._constant(torch.empty)}({shape}, "
                           f"dtype={self._expr(out.dtype, [])}, device={self._expr(out.device, [])})", []))
        self.line_ops.append("aten::empty.memory_format")
        self._track(out)
        self.storages[buffer] = _storages(out)
        if not self.symbolic_ints:
            self.fresh[buffer] = out
        self.names[id(out)] = buffer
        read = [buffer]
        arguments = [self._expr(a, read) for a in into.arguments(func, args, kwargs)]
        op = into.op
        if prologue is not None:  # the composite: prologue's arguments, then the linear's but x
            composite, prologue_exprs, prologue_read = prologue
            op, op_name = composite.op, composite.op_name
            arguments = prologue_exprs + arguments[1:]
            read += prologue_read
        target = f"v{len(self.lines)}"
        self.lines.append((f"{target} = {self._constant(op)}({', '.join([buffer] + arguments)})", read))
        self.line_ops.append(op_name)
        self.op_counts[op_name] += 1
        self.op_counts["aten::empty.memory_format"] += 1
        return out

    def _track(self, value) -> None:
        """Keeps the ids of the step's tensors unique while they have names.
        A graph of one count holds them (the step is small); a sample forgets
        a tensor's id when it dies, so a large step's activations are freed as
        in eager instead of all kept to its end."""
        if not self.symbolic_ints:
            self.alive.append(value)
            return
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor):
                weakref.finalize(item, self.names.pop, id(item), None)

    def _take_prologue(self, into: _OutForm, func, args: tuple) -> tuple | None:
        """The step's last line, if it is a prologue (`_PROLOGUES`) writing the
        x this linear reads: removed from the lines and returned as (the
        composite, the prologue's argument expressions, the names it reads)."""
        prologue, self.prologue = self.prologue, None
        if prologue is None or not args or not isinstance(args[0], torch.Tensor):
            return None
        op_name, exprs, read = prologue
        composite = _COMPOSITES.get((op_name, into.op_name))
        x = self.names.get(id(args[0]))
        if composite is None or len(exprs) != _PROLOGUES[op_name] or x is None or exprs[0] != x:
            return None
        self.lines.pop()  # the prologue returned nothing: no name refers to its line
        self.line_ops.pop()
        self.op_counts[op_name] -= 1
        return composite, exprs, read

    def _reads_step_values(self, value) -> bool:
        if isinstance(value, torch.Tensor):
            return id(value) in self.names
        if isinstance(value, (list, tuple)):
            return any(self._reads_step_values(item) for item in value)
        if isinstance(value, dict):
            return any(self._reads_step_values(item) for item in value.values())
        return False

    def _expr(self, value, read: list[str]) -> str:
        if isinstance(value, torch.Tensor):
            name = self.names.get(id(value))
            if name is not None:
                read.append(name.split("[")[0])
                return name
            if id(value) not in self.constant_names:
                self.alive.append(value)
                self.constant_names[id(value)] = self._constant(value)
            return self.constant_names[id(value)]
        if isinstance(value, (list, tuple)):
            items = [self._expr(item, read) for item in value]
            return f"[{', '.join(items)}]" if isinstance(value, list) else f"({', '.join(items)},)"
        if self.symbolic_ints and isinstance(value, int) and not isinstance(value, bool):
            self.ints.append(value)
            return _INT.format(len(self.ints) - 1)
        if value is None or isinstance(value, (bool, int, str)):
            return repr(value)
        if isinstance(value, float) and math.isfinite(value):
            return repr(value)
        return self._constant(value)

    def _constant(self, value) -> str:
        name = f"k{len(self.constants)}"
        self.constants[name] = value
        return name

    def source(self, output) -> str:
        """The step as a function; each value is dropped after its last use."""
        read: list[str] = []
        result = self._expr(output, read)
        if not self.symbolic_ints:
            self._plan_buffers(_storages(output))
        last_use: dict[str, int] = {}
        for index, (_, names) in enumerate(self.lines):
            for name in names:
                last_use[name] = index
        for name in read:
            last_use[name] = len(self.lines)
        lines = ["def step(input_ids, positions):"]
        for index, (line, names) in enumerate(self.lines):
            target = line.split(" = ", 1)[0]
            if index in self.constant_lines and target not in last_use:
                continue  # e.g. a split whose parts are all constant views too
            lines.append(f"    {line}")
            dead = sorted({n for n in names if last_use[n] == index and n.startswith("v")}
                          | ({target} if target not in last_use else set()))
            if dead:
                lines.append(f"    del {', '.join(dead)}")
        lines.append(f"    return {result}")
        return "\n".join(lines) + "\n"

    def _plan_buffers(self, output_storages: set[int]) -> None:
        """Turns the step's scratch allocations into preallocated buffers, as a
        CUDA graph's memory pool does: each `empty` whose memory is used only
        within the step (not returned) and only by ops that keep no reference
        to it (aten's, ours) reads a constant buffer instead, shared by the
        allocations whose uses do not overlap. Saves a torch.empty call (~4 us
        beside the kernels on a 2-core VM) per activation buffer."""
        last_read: dict[int, int] = {}
        readers: dict[int, set[str]] = {}
        for index, (_, names) in enumerate(self.lines):
            for name in names:
                for storage in self.storages.get(name, ()):
                    last_read[storage] = index
                    readers.setdefault(storage, set()).add(self.line_ops[index])
        free: dict[tuple, list[tuple[int, str]]] = {}  # buffer kind -> (free after line, name)
        pooled: dict[int, torch.Tensor] = {}  # recorded storage -> the buffer replacing it
        for index, (line, _) in enumerate(self.lines):
            target = line.split(" = ", 1)[0]
            tensor = self.fresh.get(target)
            if tensor is None:
                continue
            if len(self.storages[target]) != 1:
                continue
            (storage,) = self.storages[target]
            if storage in output_storages or not all(
                    op.startswith(_POOLABLE_READERS) for op in readers.get(storage, ())):
                continue
            kind = (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)
            pool = free.setdefault(kind, [])
            reusable = [entry for entry in pool if entry[0] < index]
            if reusable:
                pool.remove(reusable[0])
                buffer = reusable[0][1]
            else:
                buffer = self._constant(tensor)
                self.buffer_bytes += tensor.untyped_storage().nbytes()
            pool.append((last_read.get(storage, index), buffer))
            pooled[storage] = self.constants[buffer]
            self.lines[index] = (f"{target} = {buffer}", [])
            self.constant_lines.add(index)
            self.op_counts[self.line_ops[index]] -= 1
        # A view of a buffer is the same view every step: a constant too.
        for index, (line, _) in enumerate(self.lines):
            target = line.split(" = ", 1)[0]
            view = self.views.get(target)
            storages = self.storages.get(target, set())
            if view is None or len(storages) != 1 or next(iter(storages)) not in pooled:
                continue
            rebased = _rebase(view, pooled[next(iter(storages))])
            if rebased is not None:
                self.lines[index] = (f"{target} = {self._constant(rebased)}", [])
                self.constant_lines.add(index)
                self.op_counts[self.line_ops[index]] -= 1
        self.op_counts = +self.op_counts  # drops the ops no line calls any more


# Ops known to keep no reference to their tensor arguments after they return.
_POOLABLE_READERS = ("aten::", "cpu_backend::")


class _OutForm:
    """An op's form that writes into a given tensor, `op(out, *arguments)`,
    taking the op's arguments by name (the out tensor's dtype stands for an
    `out_dtype` argument)."""

    def __init__(self, op_name: str):
        self.op_name = op_name

    def _overload(self):
        # Looked up when recording: our ops exist once the extension is loaded.
        namespace, name = self.op_name.split("::")
        return getattr(getattr(torch.ops, namespace), name).default

    @property
    def op(self):
        return self._overload()._op

    def arguments(self, func, args: tuple, kwargs: dict) -> tuple:
        bound = {a.name: value for a, value in zip(func._schema.arguments, args)}
        bound.update(kwargs)
        return tuple(bound[a.name] if a.name in bound else a.default_value
                     for a in self._overload()._schema.arguments[1:])


# Our ops that allocate their result, by name -> the form writing into a buffer.
_OUT_FORMS = {"cpu_backend::linear": _OutForm("cpu_backend::linear_out"),
              "cpu_backend::wna16_linear": _OutForm("cpu_backend::wna16_linear_out"),
              "cpu_backend::w8a8_linear": _OutForm("cpu_backend::w8a8_linear_out")}

# Ops that write, in place, the x a linear right after them reads -> the number
# of arguments they take (the first being that x).
_PROLOGUES = {"cpu_backend::fused_add_rms_norm": 4, "cpu_backend::silu_and_mul": 2}

# (prologue, linear out form) -> the composite doing both in one call
# (csrc/prologue_linear.cpp: `<prologue>_<linear out form>`).
_COMPOSITES = {(prologue, into.op_name): _OutForm(f"{prologue}_{into.op_name.split('::')[1]}")
               for prologue in _PROLOGUES for into in _OUT_FORMS.values()}


def _rebase(view, buffer: torch.Tensor):
    """`view` (a tensor, or a tuple / list of them, over a recorded storage)
    as the same view of `buffer`, which replaces that storage; None if it is
    not expressible so (another dtype)."""
    if isinstance(view, torch.Tensor):
        if view.dtype != buffer.dtype:
            return None
        return buffer.as_strided(view.shape, view.stride(), view.storage_offset())
    if isinstance(view, (tuple, list)):
        items = [_rebase(item, buffer) for item in view]
        return None if any(item is None for item in items) else type(view)(items)
    return None


def _storages(value) -> set[int]:
    """Addresses of the memory the tensors in `value` (a tensor, or a tuple /
    list of them) live in."""
    if isinstance(value, torch.Tensor):
        pointer = value.untyped_storage().data_ptr()
        return {pointer} if pointer else set()
    if isinstance(value, (tuple, list)):
        return set().union(*(_storages(item) for item in value)) if value else set()
    return set()


class StepGraphs:
    """Per token count, a traced graph of `forward(input_ids, positions)`."""

    def __init__(self, forward: Callable[..., torch.Tensor], max_tokens: int = MAX_TOKENS,
                 lower: Lowering | None = None, capture_at_first: int = CAPTURE_AT_FIRST,
                 capture_at_sighting: int = CAPTURE_AT_SIGHTING,
                 buffer_budget: int | None = None, generic: bool = True):
        self._forward = forward
        self._lower = lower
        self.max_tokens = max_tokens
        self.capture_at_first = capture_at_first
        self.capture_at_sighting = capture_at_sighting
        # Bytes the graphs' activation buffers may hold in all (what the KV
        # sizing left for them); None: no limit.
        self.buffer_budget = buffer_budget
        self.graphs: dict[tuple, StepGraph] = {}
        self.replays: Counter[tuple] = Counter()
        self.eager_steps: Counter[tuple] = Counter()  # of larger counts not captured yet
        self.over_budget: set[tuple] = set()  # keys whose graph would not fit the budget
        self.enabled = True
        # Steps of more than max_tokens: one graph for every count (no
        # buffers: it allocates as the model does), made from two steps
        # recorded at different counts and checked against eager at a third.
        self.generic_on = generic
        self.generic: StepGraph | None = None
        self.generic_checked = False
        self.generic_replays = 0
        self._samples: list[_Sample] = []
        self._generic_misses = 0

    def covers(self, input_ids: torch.Tensor | None, intermediate_tensors,
               inputs_embeds, model_kwargs: dict) -> bool:
        return (self.enabled and input_ids is not None and intermediate_tensors is None
                and inputs_embeds is None and not model_kwargs
                and (input_ids.shape[0] <= self.max_tokens or self.generic_on))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] > self.max_tokens:
            return self._generic_step(input_ids, positions)
        key = (tuple(input_ids.shape), input_ids.dtype, tuple(positions.shape), positions.dtype)
        graph = self.graphs.get(key)
        if graph is not None:
            self.replays[key] += 1
            return graph.run(input_ids, positions)
        if key in self.over_budget or not self._fits(input_ids.shape[0] * self._bytes_per_token()):
            self._mark_over_budget(key)
            return self._forward(input_ids=input_ids, positions=positions)
        if (input_ids.shape[0] > self.capture_at_first
                and self.eager_steps[key] + 1 < self.capture_at_sighting):
            self.eager_steps[key] += 1
            return self._forward(input_ids=input_ids, positions=positions)
        return self._capture(key, input_ids, positions)

    def buffer_bytes(self) -> int:
        return sum(graph.buffer_bytes for graph in self.graphs.values())

    def _bytes_per_token(self) -> float:
        """The most buffer bytes per token of a graph so far (buffers grow
        linearly with a step's tokens)."""
        return max((graph.buffer_bytes / key[0][0] for key, graph in self.graphs.items()),
                   default=0.0)

    def _fits(self, more: float) -> bool:
        return self.buffer_budget is None or self.buffer_bytes() + more <= self.buffer_budget

    def _mark_over_budget(self, key: tuple) -> None:
        if not self.over_budget:  # the profile reserved too little: say so once
            logger.warning("cpu_backend: step graphs hold %.1f MB of buffers, their budget is "
                           "%.1f MB: steps of %d tokens (and of each count whose graph would not "
                           "fit) run eagerly.",
                           self.buffer_bytes() / 1e6, self.buffer_budget / 1e6, key[0][0])
        self.over_budget.add(key)

    def _capture(self, key: tuple, input_ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        count = input_ids.shape[0]
        start = time.perf_counter()
        try:
            _, graph = StepGraph.record(self._forward, input_ids, positions, self._lower)
            # Running a step again on the same inputs is harmless: the KV-cache
            # writes store the same values in the same slots. The reference is
            # a fresh eager run, so Python state the graph froze shows up.
            replayed = graph.run(input_ids, positions)
        except Exception as error:  # noqa: BLE001 - a failed capture means eager, not a dead engine
            self._give_up(f"capturing a step of {count} tokens failed ({error!r})")
            return self._forward(input_ids=input_ids, positions=positions)
        output = self._forward(input_ids=input_ids, positions=positions)
        if not _same(output, replayed):
            self._give_up(f"the captured step of {count} tokens differs from eager")
            return output
        if not self._fits(graph.buffer_bytes):
            self._mark_over_budget(key)
            return output
        self.graphs[key] = graph
        logger.info("cpu_backend: step graph for %d tokens captured in %.2f s (%d ops)",
                    count, time.perf_counter() - start, graph.num_ops)
        return output

    def _generic_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        count = input_ids.shape[0]
        if self.generic_checked:
            self.generic_replays += 1
            return self.generic.run(input_ids, positions)
        if count in (sample.count for sample in self._samples):
            return self._forward(input_ids=input_ids, positions=positions)
        if self.generic is not None:
            return self._check_generic(input_ids, positions)
        try:
            output, sample = _Sample.record(self._forward, input_ids, positions, self._lower)
        except Exception as error:  # noqa: BLE001 - as in _capture: eager, not a dead engine
            self._generic_off(f"recording a step of {count} tokens failed ({error!r})")
            return self._forward(input_ids=input_ids, positions=positions)
        self._samples.append(sample)
        if len(self._samples) == 2:
            self.generic = _generalize(*self._samples)
            if self.generic is None:
                self._generic_misses += 1
                if self._generic_misses >= GENERIC_ATTEMPTS:
                    self._generic_off(f"steps of {self._samples[0].count} and {count} tokens "
                                      "could not share a graph")
                self._samples = self._samples[1:]
        return output

    def _check_generic(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first replay of the graph for every count, at a count neither
        recording had: it must match a fresh eager run bit for bit."""
        count = input_ids.shape[0]
        try:
            replayed = self.generic.run(input_ids, positions)
        except Exception as error:  # noqa: BLE001
            self._generic_off(f"the graph for larger steps failed at {count} tokens ({error!r})")
            return self._forward(input_ids=input_ids, positions=positions)
        output = self._forward(input_ids=input_ids, positions=positions)
        if not _same(output, replayed):
            self._generic_off(f"the graph for larger steps differs from eager at {count} tokens")
            return output
        self.generic_checked = True
        logger.info("cpu_backend: one step graph for every count above %d tokens (recorded at "
                    "%d and %d tokens, checked at %d; %d ops)", self.max_tokens,
                    self._samples[0].count, self._samples[1].count, count, self.generic.num_ops)
        self._samples = []
        return output

    def _generic_off(self, why: str) -> None:
        logger.warning("cpu_backend: %s; steps of more than %d tokens run eagerly.", why,
                       self.max_tokens)
        self.generic_on = False
        self.generic = None
        self.generic_checked = False
        self._samples = []

    def report(self) -> dict:
        """What ran from graphs in this process, for the worker report."""
        op_calls: Counter[str] = Counter()
        for key, replays in self.replays.items():
            if key in self.graphs:
                for op, calls in self.graphs[key].op_counts.items():
                    op_calls[op] += calls * replays
        if self.generic_checked:
            for op, calls in self.generic.op_counts.items():
                op_calls[op] += calls * self.generic_replays
        return {"on": self.enabled, "token_counts": sorted(key[0][0] for key in self.graphs),
                "replays": sum(self.replays.values()) + self.generic_replays,
                "op_calls": dict(op_calls),
                "generic": {"on": self.enabled and self.generic_on,
                            "checked": self.generic_checked, "above": self.max_tokens,
                            "replays": self.generic_replays},
                "buffer_bytes": self.buffer_bytes(), "buffer_budget": self.buffer_budget}

    def _give_up(self, why: str) -> None:
        logger.warning("cpu_backend: %s; running the model eagerly from now on.", why)
        self.enabled = False
        self.graphs.clear()


class DataDependentStep(RuntimeError):
    """The step's Python reads a tensor's value: one graph cannot serve every step."""


def _shape_depends_on_values(func, args) -> bool:
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags:
        return True
    if torch.Tag.dynamic_output_shape not in tags:
        return False
    if func is torch.ops.aten.index.Tensor:  # only a boolean mask makes it so
        return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
                   for index in args[1])
    return True


# Public torch functions that run these ops through the Python argument
# parser, 1-5 us cheaper per call here than the boxed `_op` path.
_FAST_CALLS = {torch.ops.aten.view.default: torch.Tensor.view,
               torch.ops.aten.empty.memory_format: torch.empty,
               torch.ops.aten.split_with_sizes.default: torch.split_with_sizes}


def _callee(func):
    """What a graph line calls for `func`: an OpOverload's __call__ is one
    Python frame around its C++ `_op`."""
    fast = _FAST_CALLS.get(func)
    if fast is not None:
        return fast
    return func._op if isinstance(func, torch._ops.OpOverload) else func


def _same_view(func, args, out) -> bool:
    """Whether view op `func` returned a tensor indistinguishable from its
    input: same memory, shape, strides, dtype (and conjugate / negative bits)."""
    if not getattr(func, "is_view", False) or not args or not isinstance(out, torch.Tensor):
        return False
    base = args[0]
    return (isinstance(base, torch.Tensor) and out.dtype == base.dtype
            and out.data_ptr() == base.data_ptr() and out.shape == base.shape
            and out.stride() == base.stride() and out.is_conj() == base.is_conj()
            and out.is_neg() == base.is_neg())


def _tensors_or_none(value) -> bool:
    if value is None or isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and all(_tensors_or_none(v) for v in value)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    return a == b
