"""Which decode steps run as one native call: a step's forward recorded as the sequence of dispatcher
calls it makes, then replayed by `torch.classes.hyssm_cpu.OpProgram` (worker_proc/kernels/native/replay_ops.cpp)
without the Python that chose those calls.

Owns the recorded programs of one runner (`StepReplays`). Rules that hold:
- only a step of decode rows alone (one decode group, no prefill segment, no verify slice, no image row, and
  rows under adapters only where the step takes the native LoRA op, `lora_native_rows`: there the batch's
  `lora_row_slot` says which slot's tensors each row reads), on the CPU, at TP size 1, with the native
  kernels, is replayed; every other step runs its forward as written;
- a program is keyed by what the forward's Python decides from (`replay_key`): the batch's tensors'
  shapes and dtypes (the decode group's KV index width aside, which grows every step) and whether
  logits are wanted. The batch's tensors are the program's inputs; every other tensor the forward
  reads (weights, pools, cached constants) is held by the program as the object it was. So the
  forward's Python may decide from those shapes but not from the KV index width or any value;
- a key's steps are recorded until two in a row made the same calls with the same arguments and the
  same fixed tensors (at most `RECORDINGS`); then the program is built from them. A recording
  that reads a tensor's values into Python (`item`, `tolist`, a tensor made from Python data) or a
  call that returns anything but tensors refuses the key: its steps run as written from then on;
- the programs hold the model's weights as bound, and the adapters' tensors as loaded: `clear()` when the model
  is bound again or an adapter slot changes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from worker_proc.model.batch import StepBatch

logger = logging.getLogger(__name__)

RECORDINGS = 3
"""Recordings of one batch shape before it is refused: its first step may also fill lazily made constants
(a float32 copy of a weight the kernels read), so a second and third may agree where the first did not."""

MAX_PROGRAMS = 64
"""Programs kept (the least recently run goes first): one per batch size a server decodes at."""

REFUSED_OPS = frozenset({
    "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::lift_fresh",
    "aten::lift", "aten::lift_fresh_copy", "aten::resolve_conj", "aten::resolve_neg",
})
"""Calls that hand a tensor's values to Python or take a tensor made from Python data (`tolist` shows only
as `resolve_conj`/`resolve_neg`): what the Python then decided cannot be replayed."""

# the argument kinds of replay_ops.cpp
(NONE, TENSOR, REGISTER, INT, FLOAT, BOOL, INT_LIST, FLOAT_LIST, TENSOR_LIST, STRING, DEVICE, DTYPE, BOOL_LIST, NUMBER,
 INT_NUMBER) = range(15)
_MEMORY_FORMATS = {torch.contiguous_format: 0, torch.preserve_format: 1, torch.channels_last: 2,
                   torch.channels_last_3d: 3}  # fmt: skip


class Unreplayable(Exception):
    """A recorded call that a program cannot repeat."""


@dataclass
class EncodedCall:
    """One dispatcher call as `OpProgram.add` takes it."""

    name: str
    overload: str
    kinds: list[int] = field(default_factory=list)
    ints: list[int] = field(default_factory=list)
    floats: list[float] = field(default_factory=list)
    strs: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    outs: list[int] = field(default_factory=list)

    def same_as(self, other: EncodedCall) -> bool:
        """The same call with the same arguments, fixed tensors compared as objects."""
        fields = (self.name, self.overload, self.kinds, self.ints, self.floats, self.strs, self.outs)
        if fields != (other.name, other.overload, other.kinds, other.ints, other.floats, other.strs, other.outs):
            return False
        return len(self.tensors) == len(other.tensors) and all(
            a is b for a, b in zip(self.tensors, other.tensors, strict=True))


class Recorder(TorchDispatchMode):
    """Records every dispatcher call made while it is active, over `inputs` (registers 0..n-1)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch then leaves `__torch_dispatch__` unwrapped. Its wrapper, for a mode entered under
        torch.compile (the recorder never is), imports torch._dynamo at the first recorded call, which holds
        about 140 MiB of resident memory in every worker for as long as it lives."""
        return False

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.inputs = list(inputs)
        self.registers = {id(t): i for i, t in enumerate(inputs)}
        self.held: list[object] = list(inputs)  # every tensor seen stays alive, so no id is reused
        self.count = len(inputs)
        self.calls: list[EncodedCall] = []
        self.refusal = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.refusal:
            try:
                self.calls.append(self._encode(func, args, kwargs, out))
            except Unreplayable as exc:
                self.refusal = str(exc)
        return out

    def register_of(self, t: torch.Tensor) -> int | None:
        return self.registers.get(id(t))

    def _encode(self, func: Any, args: tuple, kwargs: dict, out: Any) -> EncodedCall:
        schema = func._schema
        if schema.name in REFUSED_OPS:
            raise Unreplayable(f"{schema.name} reads a tensor's values into Python")
        call = EncodedCall(schema.name, schema.overload_name)
        for i, arg in enumerate(schema.arguments):
            if i < len(args) and not arg.kwarg_only:
                value = args[i]
            elif arg.name in kwargs:
                value = kwargs[arg.name]
            elif arg.has_default_value():
                value = arg.default_value
            else:
                raise Unreplayable(f"{schema.name}: no value for {arg.name}")
            self._encode_value(call, str(arg.type), value)
        self.held.append((args, kwargs, out))
        results = out if isinstance(out, list | tuple) else () if out is None else (out,)
        for t in results:
            if not isinstance(t, torch.Tensor):
                raise Unreplayable(f"{schema.name} returns {type(t).__name__}")
            self.registers[id(t)] = self.count
            call.outs.append(self.count)
            self.count += 1
        return call

    def _encode_value(self, call: EncodedCall, kind: str, value: object) -> None:
        if value is None:
            call.kinds.append(NONE)
        elif isinstance(value, torch.Tensor):
            self._encode_tensor(call, value)
        elif kind == "Tensor" and isinstance(value, int | float) and not isinstance(value, bool):
            call.kinds.append(INT_NUMBER if isinstance(value, int) else NUMBER)  # the parser's wrapped number
            (call.ints if isinstance(value, int) else call.floats).append(value)
        elif isinstance(value, bool):
            call.kinds.append(BOOL)
            call.ints.append(int(value))
        elif isinstance(value, int) and "float" not in kind:
            call.kinds.append(INT)
            call.ints.append(value)
        elif isinstance(value, int | float):
            call.kinds.append(FLOAT)
            call.floats.append(float(value))
        elif isinstance(value, torch.dtype):
            call.kinds.append(DTYPE)
            call.strs.append(str(value).removeprefix("torch."))
        elif isinstance(value, torch.device):
            call.kinds.append(DEVICE)
            call.strs.append(str(value))
        elif isinstance(value, torch.layout) and value == torch.strided:
            call.kinds.append(INT)
            call.ints.append(0)
        elif isinstance(value, torch.memory_format):
            call.kinds.append(INT)
            call.ints.append(_MEMORY_FORMATS[value])
        elif isinstance(value, str):
            call.kinds.append(STRING)
            call.strs.append(value)
        elif isinstance(value, list | tuple):
            self._encode_list(call, kind, list(value))
        else:
            raise Unreplayable(f"{call.name}: an argument of type {type(value).__name__}")

    def _encode_tensor(self, call: EncodedCall, t: torch.Tensor) -> None:
        reg = self.register_of(t)
        if reg is None:
            call.kinds.append(TENSOR)
            call.tensors.append(t)
            self.held.append(t)
        else:
            call.kinds.append(REGISTER)
            call.ints.append(reg)

    def _encode_list(self, call: EncodedCall, kind: str, values: list) -> None:
        if "Tensor" in kind:
            call.kinds.append(TENSOR_LIST)
            call.ints += [int("Optional[Tensor]" in kind), len(values)]
            for v in values:
                if v is None:
                    call.ints += [NONE, 0]
                    continue
                reg = self.register_of(v)
                call.ints += [TENSOR, 0] if reg is None else [REGISTER, reg]
                if reg is None:
                    call.tensors.append(v)
            return
        if all(isinstance(v, bool) for v in values) and "bool" in kind:
            call.kinds.append(BOOL_LIST)
            call.ints += [len(values), *map(int, values)]
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values) and "float" not in kind:
            call.kinds.append(INT_LIST)
            call.ints += [len(values), *values]
        elif all(isinstance(v, int | float) for v in values):
            call.kinds.append(FLOAT_LIST)
            call.ints.append(len(values))
            call.floats += map(float, values)
        else:
            raise Unreplayable(f"{call.name}: a list argument of {kind}")


def replay_inputs(sb: StepBatch) -> list[torch.Tensor]:
    """The tensors of a decode-only batch a program takes as inputs, in register order."""
    g = sb.decode_groups[0]
    rope = [] if sb.rope_positions is None else [sb.rope_positions]
    lora = [] if sb.lora_row_slot is None else [sb.lora_row_slot]
    return [sb.input_ids, sb.positions, sb.new_kv_slots, sb.logit_rows, g.rows, g.state_slots, g.kv_idx, g.kv_len,
            *rope, *lora]


def replay_key(sb: StepBatch, want_logits: bool, lora_native_rows: int = 0) -> tuple | None:
    """What a decode step's forward decides from, or None when the step is not one a program may run."""
    if (sb.prefill or len(sb.decode_groups) != 1 or sb.kept_inputs is not None or sb.image_spans
            or (sb.lora_rows and sb.input_ids.shape[0] > lora_native_rows) or sb.input_ids.device.type != "cpu"):
        return None
    shapes = tuple((tuple(t.shape), t.dtype) for t in replay_inputs(sb))
    kv = shapes[6]
    return (want_logits, *shapes[:6], (kv[0][0], kv[1]), *shapes[7:])


def _difference(first: list[EncodedCall], second: list[EncodedCall]) -> str:
    """Where two recordings of one batch shape part ("" where they agree)."""
    for i, (a, b) in enumerate(zip(first, second, strict=False)):
        if not a.same_as(b):
            return (f"two steps of the batch made different calls (call {i}: {a.name}.{a.overload} "
                    f"{a.ints}{a.floats}, then {b.name}.{b.overload} {b.ints}{b.floats})")
    if len(first) != len(second):
        return f"two steps of the batch made {len(first)} and {len(second)} calls"
    return ""


@dataclass
class _Pending:
    """A key's latest recording (its `recordings`-th), kept until the next step's is compared with it."""

    calls: list[EncodedCall]  # their fixed tensors only: the step's own tensors went with its recorder
    output: int
    recordings: int = 1


@dataclass
class _Program:
    program: Any  # torch.classes.hyssm_cpu.OpProgram
    output: int

    @classmethod
    def build(cls, calls: list[EncodedCall], output: int, inputs: int) -> _Program:
        program = torch.classes.hyssm_cpu.OpProgram(inputs)
        for c in calls:
            program.add(c.name, c.overload, c.kinds, c.ints, c.floats, c.strs, c.tensors, c.outs)
        return cls(program, output)

    def run(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self.program.run(inputs, [self.output])[0]


class StepReplays:
    """The recorded programs of one runner's decode steps (see the module doc); `enabled` is False under
    --enforce-eager, at TP size above 1 and without the native kernels. `lora_native_rows`: the runner's
    adapter slots' (LoraSlots.native_rows; 0 without adapters)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.lora_native_rows = 0
        self._programs: OrderedDict[tuple, _Pending | _Program | str] = OrderedDict()  # a str: the refusal
        self._told: set[str] = set()  # refusals logged (once each, not once per batch shape)
        self.replayed = 0

    def clear(self) -> None:
        self._programs.clear()

    def programs(self) -> int:
        """How many batch shapes have a program."""
        return sum(isinstance(e, _Program) for e in self._programs.values())

    def refusals(self) -> list[str]:
        """Why each refused batch shape runs as written."""
        return [e for e in self._programs.values() if isinstance(e, str)]

    def forward(self, sb: StepBatch, want_logits: bool, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The step's logits: `run()` (the forward as written), recorded or replayed by the rules above."""
        key = replay_key(sb, want_logits, self.lora_native_rows) if self.enabled else None
        if key is None:
            return run()
        entry = self._programs.get(key)
        if isinstance(entry, str):
            return run()
        if isinstance(entry, _Program):
            self._programs.move_to_end(key)
            self.replayed += 1
            return entry.run(replay_inputs(sb))
        recorder = Recorder(replay_inputs(sb))
        with recorder:
            out = run()
        self._after_recording(key, entry, recorder, out)
        return out

    def _after_recording(self, key: tuple, entry: _Pending | None, recorder: Recorder, out: torch.Tensor) -> None:
        output = recorder.register_of(out)
        refusal = recorder.refusal or ("" if output is not None else "the logits are not a call's result")
        if not refusal and entry is not None:
            refusal = _difference(entry.calls, recorder.calls) or (
                "" if entry.output == output else "two steps of the batch returned different tensors")
            if refusal and entry.recordings < RECORDINGS - 1:  # the next step may agree with this one
                assert output is not None
                self._store(key, _Pending(recorder.calls, output, entry.recordings + 1))
                return
        if refusal:
            self._refuse(key, refusal)
            return
        assert output is not None
        if entry is None:
            self._store(key, _Pending(recorder.calls, output))
            return
        try:
            program = _Program.build(recorder.calls, output, len(recorder.inputs))
        except RuntimeError as exc:  # a call the program cannot encode: refused before any step depends on it
            self._refuse(key, str(exc).splitlines()[0])
            return
        self._store(key, program)
        logger.debug("decode steps of %d rows replay %d recorded calls", key[1][0][0], len(recorder.calls))

    def _refuse(self, key: tuple, refusal: str) -> None:
        if refusal not in self._told:
            self._told.add(refusal)
            logger.info("decode steps of %d rows run as written (and others for the same reason): %s", key[1][0][0],
                        refusal)
        self._store(key, refusal)

    def _store(self, key: tuple, entry: _Pending | _Program | str) -> None:
        self._programs[key] = entry
        self._programs.move_to_end(key)
        while len(self._programs) > MAX_PROGRAMS:
            self._programs.popitem(last=False)
