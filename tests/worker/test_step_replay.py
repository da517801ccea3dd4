"""Replayed decode steps (worker_proc.runtime.step_replay): for every family a replayed step gives the logits and
leaves the state of the step run as written, bitwise; a recording whose Python reads tensor values or
decides differently from one step to the next is never replayed; a program repeats its calls on new
inputs (registers, fixed tensors, lists, numbers)."""

from __future__ import annotations

import pytest
import torch

from shared.messages import ReqSlice
from tests.model_driver import forward_logits
from tests.worker.util import ALL_FIXTURES, GDN_FIXTURES, batch, max_diff, req, runner
from worker_proc.kernels import native
from worker_proc.linear.kernels import DENSE, DEQUANT, GATHERED_INT8, GATHERED_SEQ, GEMV_W8A8, GemmKernel
from worker_proc.model.batch import DecodeGroup, StepBatch
from worker_proc.plan.execution_plan import fixed_plan, product_sites
from worker_proc.runtime.runner import ModelRunner
from worker_proc.runtime.step_replay import RECORDINGS, Recorder, StepReplays, _Program

pytestmark = pytest.mark.skipif(not native.load(), reason="no native kernels on this machine")

DECODE_STEPS = 6
# routed experts: replayed where every expert product gathers (GemmSite.gathers: the plan's method for
# the step's rows is a gathered kernel), else grouped by expert, which reads the choices into Python
MOE_FIXTURES = ("rope_moe", "nemotron_h_moe", "qwen3_next_moe", "qwen3_5_moe")


def _gathers(r: ModelRunner, rows: int) -> bool:
    sites = [site for _, site, _ in product_sites(r.model) if not site.packable and site.quantizable]
    assert sites
    return all(site.gathers(rows) for site in sites)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def _decode(r: ModelRunner, rows: int) -> list[dict[str, torch.Tensor]]:
    """`rows` requests prefilled, then decoded together for DECODE_STEPS steps: each step's logits."""
    prompts = [_prompt(i, 70 + 3 * i) for i in range(rows)]
    kv = [list(range(1 + 100 * i, 1 + 100 * i + len(p) + DECODE_STEPS)) for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        forward_logits(r, batch(i, [req(f"r{i}", p, 0, kv[i][: len(p)], i + 1)], clears=[i + 1]))
    out = []
    for s in range(DECODE_STEPS):
        slices: list[ReqSlice] = []
        for i, p in enumerate(prompts):
            n = len(p) + s
            slices.append(req(f"r{i}", [(7 * n + i) % 250 + 3], n, kv[i][: n + 1], i + 1))
        out.append(forward_logits(r, batch(10 + s, slices)))
    return out


@pytest.mark.parametrize("name", [*ALL_FIXTURES, *GDN_FIXTURES])
def test_replayed_decode_equals_eager(name: str) -> None:
    eager = runner(name, kv_slots=400, enforce_eager=True)
    replayed = runner(name, kv_slots=400)
    assert not eager.replays.enabled and replayed.replays.enabled
    for rows in (1, 3):
        want, got = _decode(eager, rows), _decode(replayed, rows)
        for step, (w, g) in enumerate(zip(want, got, strict=True)):
            for rid in w:
                assert torch.equal(g[rid], w[rid]), (rows, step, rid)
    for pool, t in eager.pools.states.items():
        assert torch.equal(replayed.pools.states[pool], t), pool
    for a, b in zip(eager.pools.k + eager.pools.v, replayed.pools.k + replayed.pools.v, strict=True):
        assert torch.equal(a, b)
    # two decode batch sizes, each recorded twice and replayed from then on
    as_written = [] if name not in MOE_FIXTURES else [rows for rows in (1, 3) if not _gathers(replayed, rows)]
    assert replayed.replays.replayed == (2 - len(as_written)) * (DECODE_STEPS - 2)
    refusals = replayed.replays.refusals()
    assert len(refusals) == len(as_written), refusals


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_routed_experts_replay_where_their_products_gather(name: str) -> None:
    """On a plan binding the gathered expert kernel, every expert product gathers: a MoE decode
    step is replayed, bitwise the step as written, and within rounding of the same step grouped by expert."""
    runners = [runner(name, kv_slots=400, enforce_eager=eager) for eager in (True, False)]
    for r in runners:
        r.bind_plan(fixed_plan(r.model, {"dense": GATHERED_SEQ}))
        assert _gathers(r, 1) and _gathers(r, 3)
    grouped = runner(name, kv_slots=400, enforce_eager=True)
    grouped.bind_plan(fixed_plan(grouped.model, {"dense": DENSE}))
    assert not _gathers(grouped, 1)
    for rows in (1, 3):
        want, got, near = (_decode(r, rows) for r in (runners[0], runners[1], grouped))
        for w, g, n in zip(want, got, near, strict=True):
            for rid in w:
                assert torch.equal(g[rid], w[rid]) and max_diff(g[rid], n[rid]) <= 2e-3, rid
    assert runners[1].replays.replayed == 2 * (DECODE_STEPS - 2) and not runners[1].replays.refusals()


def test_int8_experts_gather_and_replay() -> None:
    """An int8 expert stack gathers where the plan binds the gathered int8 kernel (its int8 matrices read with their
    row scales): replayed, bitwise the step as written, and within float32 rounding of the same weights
    dequantized and grouped by expert."""
    def quantized(eager: bool, methods: dict[str, GemmKernel]) -> ModelRunner:
        r = runner("rope_moe", kv_slots=400, enforce_eager=eager, quantization="int8")
        r.bind_plan(fixed_plan(r.model, methods))
        return r

    gathered = [quantized(eager, {"dense": GATHERED_SEQ, "int8": GATHERED_INT8}) for eager in (True, False)]
    grouped = quantized(True, {"dense": DENSE, "int8": DEQUANT["int8"]})
    assert _gathers(gathered[1], 1) and not _gathers(grouped, 1)
    want, got, near = (_decode(r, 1) for r in (gathered[0], gathered[1], grouped))
    for w, g, n in zip(want, got, near, strict=True):
        assert torch.equal(g["r0"], w["r0"]) and max_diff(g["r0"], n["r0"]) <= 2e-3
    assert gathered[1].replays.replayed == DECODE_STEPS - 2 and not gathered[1].replays.refusals()
    grouped.bind_plan(fixed_plan(grouped.model, {"dense": DENSE, "int8": GEMV_W8A8}))
    assert not _gathers(grouped, 1)  # a per-expert kernel runs per expert: what runs is what the plan timed


def test_rebinding_the_plan_drops_the_programs() -> None:
    r = runner("nope_groups2", kv_slots=400)
    _decode(r, 1)
    assert r.replays.programs() == 1
    r.bind_plan(r.plan)
    assert r.replays.programs() == 0


def _record(fn, inputs: list[torch.Tensor]) -> Recorder:  # type: ignore[no-untyped-def]
    recorder = Recorder(inputs)
    with torch.inference_mode(), recorder:
        recorder.result = fn(*inputs)  # type: ignore[attr-defined]
    return recorder


def _program(recorder: Recorder, inputs: int) -> _Program:
    out = recorder.register_of(recorder.result)  # type: ignore[attr-defined]
    assert out is not None and not recorder.refusal
    return _Program.build(recorder.calls, out, inputs)


def test_program_repeats_its_calls_on_new_inputs() -> None:
    weight = torch.randn(5, 4)

    def fn(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        a, b = (x * 2.5 + 1).split([2, 2], dim=-1)  # wrapped numbers, a list return
        y = torch.cat([a, weight[:, :2], b], dim=0)  # registers and a fixed tensor in one list
        z = y[idx] if idx.numel() else y  # an index list
        return torch.nn.functional.linear(z.to(torch.float64).float(), weight[:, :2].contiguous()).sum(-1)

    x0, i0 = torch.randn(3, 4), torch.tensor([1, 4, 0])
    program = _program(_record(fn, [x0, i0]), 2)
    for _ in range(3):
        x, i = torch.randn(3, 4), torch.randint(0, 8, (3,))
        assert torch.equal(program.run([x, i]), fn(x, i))


def test_a_bool_passed_as_a_scalar_replays() -> None:
    """Routing masks (`scatter_(..., True)`): the schema's Scalar takes a bool, which is no number type."""

    def fn(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros(x.shape, dtype=torch.bool).scatter_(1, idx, True)
        return x.masked_fill(~keep, float("-inf")).softmax(-1)

    program = _program(_record(fn, [torch.randn(2, 5), torch.tensor([[0, 3], [4, 1]])]), 2)
    x, i = torch.randn(2, 5), torch.tensor([[2, 1], [0, 4]])
    assert torch.equal(program.run([x, i]), fn(x, i))


def test_reading_values_into_python_refuses() -> None:
    for fn in (lambda x: x * int(x[0]), lambda x: x + x.tolist()[0], lambda x: x * 2 if bool(x.sum() > 0) else x,
               lambda x: x + torch.tensor([1.0])):
        assert _record(fn, [torch.ones(3)]).refusal


def _decode_batch(width: int) -> StepBatch:
    """A one-row decode batch whose KV index is `width` wide (the fields replay_key reads)."""
    t = torch.tensor([1])
    group = DecodeGroup(t, t, torch.zeros(1, width, dtype=torch.int64), t)
    return StepBatch(t, t, t, (), (group,), t, ("a",))


def test_calls_that_differ_from_step_to_step_refuse() -> None:
    replays = StepReplays(enabled=True)
    for step in range(RECORDINGS):
        sb = _decode_batch(4 + step)
        replays.forward(sb, True, lambda sb=sb, step=step: sb.input_ids * float(step))  # another constant each step
    assert replays.programs() == 0 and len(replays.refusals()) == 1
    assert "different calls" in replays.refusals()[0]


def test_a_first_step_that_fills_a_cache_is_recorded_again() -> None:
    replays = StepReplays(enabled=True)
    weight = torch.randn(3)
    cache: dict[str, torch.Tensor] = {}

    def forward(sb: StepBatch) -> torch.Tensor:
        if "w" not in cache:
            cache["w"] = weight.double()  # a lazily made constant: a call the first step alone makes
        return sb.input_ids * cache["w"]

    outs = []
    for step in range(6):
        sb = _decode_batch(4 + step)
        sb.input_ids.fill_(step)
        outs.append(replays.forward(sb, True, lambda sb=sb: forward(sb)))
    assert replays.programs() == 1 and replays.replayed == 3
    for step, out in enumerate(outs):
        assert torch.equal(out, step * weight.double())


def test_a_call_encoded_wrong_is_refused_by_the_program() -> None:
    program = torch.classes.hyssm_cpu.OpProgram(1)
    with pytest.raises(RuntimeError, match="takes 3 arguments, 1 given"):
        program.add("aten::add", "Tensor", [2], [0], [], [], [], [1])
    with pytest.raises(RuntimeError, match="before it is set"):
        program.add("aten::neg", "", [2], [5], [], [], [], [1])
    with pytest.raises(RuntimeError, match="1 inputs expected"):
        program.run([], [0])
    with pytest.raises(RuntimeError, match="argument other is str, the schema takes Tensor"):
        program.add("aten::mul", "Tensor", [1, 9], [], [], ["x"], [torch.ones(1)], [1])


def test_a_list_takes_the_type_the_schema_names() -> None:
    """oneDNN's packed product takes `Scalar?[] scalars`: an empty list recorded as ints is built as that type."""
    from worker_proc.linear.kernels import pack_weight, packed_product

    packed = pack_weight(torch.randn(24, 16))
    program = _program(_record(lambda x: packed_product(x, packed, None), [torch.randn(3, 16)]), 1)
    x = torch.randn(3, 16)
    assert torch.equal(program.run([x]), packed_product(x, packed, None))


def test_a_run_keeps_no_tensor_of_its_own() -> None:
    """A register put into a list argument (torch.cat's) is not held by the program after the run."""
    import weakref

    program = _program(_record(lambda x: torch.cat([x, x + 1]).sum(0), [torch.randn(2, 3)]), 1)
    x = torch.randn(2, 3)
    seen = weakref.ref(x)
    out = program.run([x])
    assert torch.equal(out, torch.cat([x, x + 1]).sum(0))
    del x
    assert seen() is None


def test_recording_and_replaying_steps_never_imports_torch_dynamo() -> None:
    """torch wraps a dispatch mode's handler for use under torch.compile, and the wrapper imports torch._dynamo
    (about 140 MiB resident, the worker's for as long as it lives) at its first call: the recorder opts out, so
    a runner that records and replays its decode steps never imports it."""
    import subprocess
    import sys

    code = ("import sys; from tests.worker.test_step_replay import _decode; from tests.worker.util import runner; "
            "r = runner('nope_groups2', kv_slots=400); _decode(r, 1); "
            "print(r.replays.programs(), r.replays.replayed, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    programs, replayed, imported = out.stdout.split()[-3:]
    assert int(programs) == 1 and int(replayed) > 0 and imported == "False", out.stdout
