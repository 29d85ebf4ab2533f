"""Compile every Triton kernel of lion_vit for GPUs, on a machine without one.

The tests run the kernels under Triton's interpreter, which executes their Python with numpy: it accepts
programs that the GPU compiler rejects (a loop variable whose type changes, more shared memory than a GPU
has) and cannot run bfloat16. This script runs the triton backend's attention, chunk and rnn forms under
the interpreter on small inputs (float32 and float16, every decay kind, one and two scans, every fused
feature map and scaling, training and inference) and data.decode=gpu's crop resize (lion_vit.data.resize),
records every launch of lion_vit's own kernels (not FLA's), and compiles each distinct launch to a cubin for
each target with Triton's compiler and ptxas, as a GPU's first call would: float16 launches also in bfloat16,
the dtype GPUs train in.

    python scripts/compile_kernels.py                    # sm_90 (H100, H200) and sm_80 (A100)
    python scripts/compile_kernels.py --arch 90 --quick  # fewer calls, each kernel's code once (tests/test_triton.py)
    python scripts/compile_kernels.py --save-records launches.json   # then, with another Triton on PYTHONPATH:
    PYTHONPATH=/tmp/triton python scripts/compile_kernels.py --records launches.json

Prints a line per compiled launch (target, kernel, dtype, constexpr flags, shared memory, and from the
cubin its registers per thread, stack frame and local memory, which is where registers spill; from the PTX its
tensor-core instructions; the blocks a multiprocessor fits by registers and shared memory; with --loops, from the
SASS the instructions of its loops' code, special-function ones and barriers apart) and exits 1
if any fails, with the compiler's message. --records FILE compiles launches recorded before (JSON: module,
kernel, args, kwargs; a tensor is {"tensor": dtype, "aligned": bool}) instead of recording them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone, installed or not (lion_vit is imported where used)
sys.path.insert(0, str(ROOT / "scripts"))  # the scripts' shared helpers (benchmarking.py)

from benchmarking import launch_setting  # noqa: E402

# the most shared memory a block may use, by compute capability (CUDA C++ Programming Guide)
SHARED_MEMORY = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def call(dtype, decay, scans, form, feature_map, training, scaling="sum", length=20, width=64) -> None:
    """One call of the triton backend (and its backward in training): decay "lit", "fixed" (one per head) or
    "selective" (one per token), one scan in token order or two (snakes over a 4 x 5 grid: length 20)."""
    import torch
    import torch.nn.functional as F

    from lion_vit.ops import Plan, lion_attention, snake_orders

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, length, width, generator=g).to(dtype).requires_grad_(training) for _ in "qkv")
    logits = torch.randn(2, 2, length if decay == "selective" else 1, generator=g) + 3
    log_decay = None if decay == "lit" else F.logsigmoid(logits).requires_grad_(training)
    # the kernels' plan at any length (dispatch.plan runs short sequences as one torch product); the attention
    # form: the bidirectional kernel, LION-lit's its linear kernels
    plan = Plan(form, "triton", whole=form == "attention", chunks=2 if form == "chunk" else 1,
                grouped=not training and form != "attention", linear=form == "attention" and decay == "lit")
    with torch.set_grad_enabled(training):
        if scans == 1:
            y = lion_attention(q, k, v, None if log_decay is None else log_decay[None], plan=plan,
                               feature_map=feature_map, scaling=scaling)
        else:
            decays = None if log_decay is None else torch.stack([log_decay, log_decay / 2])
            y = lion_attention(q, k, v, decays, snake_orders(4, 5), plan=plan, feature_map=feature_map,
                               scaling=scaling)
        if training:
            y.float().sum().backward()


def calls(quick: bool):
    """Thunks that each run one call of the triton backend (and its backward in training)."""
    import torch

    cases = [(decay, scans, form, feature_map, training)
             for decay, scans in [("lit", 1), ("fixed", 1), ("selective", 1), ("fixed", 2), ("selective", 2)]
             for form in ("attention", "chunk", "rnn")
             for feature_map in ("silu", "silu_norm", "elu", None) for training in (True, False)]
    cases += [(decay, scans, form, "identity", training, scaling)  # the other scalings (ops/scalings.py)
              for decay, scans in [("lit", 1), ("fixed", 1), ("selective", 2)]
              for form in ("attention", "chunk", "rnn")
              for training in (True, False) for scaling in ("none", "max")]
    # the bidirectional kernel's float64 exponents (bidirectional.FLOAT64_EXPONENTS_ABOVE: longer sequences)
    long = [("selective", 1, "attention", "silu_norm", True, "sum", 1100),
            ("fixed", 1, "attention", None, False, "sum", 1100)]
    cases += long
    if quick:  # every kernel and every value of its flags at least once
        cases = [("lit", 1, "rnn", "silu_norm", True), ("selective", 2, "chunk", "elu", True),
                 ("fixed", 1, "chunk", None, False), ("selective", 2, "attention", "silu_norm", False),
                 ("fixed", 1, "chunk", "identity", True, "none"), ("selective", 2, "rnn", "identity", True, "max"),
                 ("selective", 2, "attention", "silu_norm", True), ("fixed", 1, "attention", None, False),
                 ("fixed", 1, "attention", "identity", True, "none"),
                 ("selective", 2, "attention", "identity", True, "max"), ("lit", 1, "attention", "silu_norm", True),
                 ("lit", 1, "attention", None, False), ("lit", 1, "attention", "identity", True, "none"),
                 ("lit", 1, "attention", "identity", True, "max"), *long]
    for dtype in (torch.float32, torch.float16):
        for case in cases:
            yield lambda dtype=dtype, case=case: call(dtype, *case)
    yield crops


def crops() -> None:
    """data.decode=gpu's crops resized in lion_vit.data.resize's kernel: either order of the passes, both filters."""
    import torch

    from lion_vit.data.resize import resized_crops
    images = [torch.zeros(3, 40, 50, dtype=torch.uint8), torch.zeros(3, 30, 30, dtype=torch.uint8)]
    resized_crops(images, [(2, 3, 30, 40), (0, 0, 30, 30)], (20, 28), [True, False])


def recorded_launches(quick: bool, knobs: Optional[dict] = None, thunks=None) -> list:
    """Runs `calls` (or the thunks given) under the interpreter (TRITON_INTERPRET=1), launching no kernel, and
    returns the distinct launches of lion_vit's kernels: [module, kernel, args, kwargs], tensors described by dtype
    and alignment. knobs: lion_vit.ops.Tuning settings the calls run with (the bidirectional kernel's launch
    settings)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import interpret  # the interpreter's adaptations for FLA's kernels (tests/interpret.py)
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    interpret.adapt_interpreter()
    launches = {}

    def describe(value):
        if isinstance(value, torch.Tensor):
            return {"tensor": str(value.dtype)[6:], "aligned": value.data_ptr() % 16 == 0}
        return value

    def recording(self, *args, grid, warmup, **kwargs):  # (no kernel runs: only the launches' arguments matter)
        if self.fn.__module__.startswith("lion_vit."):
            launch = [self.fn.__module__, self.fn.__name__, [describe(a) for a in args],
                      {key: describe(value) for key, value in kwargs.items()}]
            launches.setdefault(json.dumps(launch), launch)

    from lion_vit.ops import tuned
    run, InterpretedFunction.run = InterpretedFunction.run, recording
    try:
        with tuned(**(knobs or {})):
            for thunk in calls(quick) if thunks is None else thunks:
                thunk()
    finally:
        InterpretedFunction.run = run
    return list(launches.values())


class _Target:
    """A driver for Triton's compiler that names a GPU target and launches nothing (JITFunction.warmup
    compiles without launching); each target is a device of its own, so its compiled kernels are apart."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.arch, self.target = arch, GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return self.arch

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def _variants(launch):
    """The launch as recorded and, where it reads float16 tensors, as the same launch in bfloat16."""
    yield launch
    module, name, args, kwargs = launch
    swap = lambda a: dict(a, tensor="bfloat16") if isinstance(a, dict) and a["tensor"] == "float16" else a  # noqa: E731
    if any(isinstance(a, dict) and a["tensor"] == "float16" for a in [*args, *kwargs.values()]):
        yield [module, name, [swap(a) for a in args], {key: swap(value) for key, value in kwargs.items()}]


def _dtype(launch) -> str:
    """The launch's 16-bit float dtype, or float32."""
    tensors = {a["tensor"] for a in [*launch[2], *launch[3].values()] if isinstance(a, dict)}
    return next((t for t in ("float16", "bfloat16") if t in tensors), "float32")


def _code(launch) -> tuple:
    """What a launch's code depends on but its 16-bit dtype: the kernel, its constexpr flags, and its arguments'
    kinds (a tensor's dtype, float16 and bfloat16 read as float32; a number's type), not their values."""
    module, name, args, kwargs = launch

    def kind(value):
        if isinstance(value, dict):
            return "float32" if value["tensor"] in ("float16", "bfloat16") else value["tensor"]
        return type(value).__name__

    return module, name, tuple(map(kind, args)), tuple((k, v if k.isupper() else kind(v)) for k, v in kwargs.items())


def to_compile(launches, quick: bool) -> list:
    """The launches to compile: each recorded launch and its bfloat16 variant; with `quick`, each distinct code
    (`_code`: every setting of every kernel's flags) once, in bfloat16 where it reads 16-bit tensors (the dtype
    GPUs train in), and each kernel once more in float32 and in float16."""
    launches = [variant for recorded in launches for variant in _variants(recorded)]
    if not quick:
        return launches
    chosen = {}
    for launch in launches:  # the first launch of each code, or its bfloat16 one
        code = _code(launch)
        if code not in chosen or (_dtype(launch) == "bfloat16" and _dtype(chosen[code]) != "bfloat16"):
            chosen[code] = launch
    kept = {id(launch) for launch in chosen.values()}
    covered = {(launch[1], _dtype(launch)) for launch in chosen.values()}
    for launch in launches:
        if (launch[1], _dtype(launch)) not in covered:
            kept.add(id(launch))
            covered.add((launch[1], _dtype(launch)))
    return [launch for launch in launches if id(launch) in kept]


def nvidia_tool(name: str) -> Optional[str]:
    """The path of an NVIDIA tool as Triton's compiler finds it ("ptxas", "cuobjdump": TRITON_<NAME>_PATH, else
    the one its Linux x86-64 wheels ship), or None where there is none."""
    try:
        from triton import knobs
        return getattr(knobs.nvidia, name).path
    except (ImportError, AttributeError, RuntimeError):  # (Triton before knobs, or no such tool)
        return None


def _cuobjdump(compiled, option: str) -> Optional[str]:
    """What cuobjdump `option` prints of the launch's cubin; None where there is no cubin or no tool."""
    tool = nvidia_tool("cuobjdump")
    if "cubin" not in compiled.asm or tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([tool, option, cubin.name], capture_output=True, text=True).stdout


def resources(compiled) -> Optional[Tuple[int, int, int]]:
    """(registers a thread, stack B, local B) from the cubin's resource usage (cuobjdump): stack or local > 0 means
    that the kernel spills registers to memory (ptxas puts spills in the stack frame); None where the tool is
    missing."""
    found = re.search(r"REG:(\d+) STACK:(\d+).*LOCAL:(\d+)", _cuobjdump(compiled, "--dump-resource-usage") or "")
    return (int(found[1]), int(found[2]), int(found[3])) if found else None


def _tensor_cores(compiled) -> str:
    """", wgmma W, mma.sync M" from the PTX: its products' tensor-core instructions (wgmma: Hopper's warpgroup ones;
    mma.sync: the per-warp ones of earlier GPUs, below Hopper's peak rate there)."""
    ptx = compiled.asm.get("ptx", "")
    return f", wgmma {len(re.findall(r'wgmma.mma_async', ptx))}, mma.sync {len(re.findall(r'mma.sync', ptx))}"


def blocks_per_multiprocessor(compiled, registers: int, arch: int) -> int:
    """How many of the launch's blocks its registers (a thread's `registers`; 64 K a multiprocessor, allotted 8 a
    thread at a time) and shared memory leave room for at once, the occupancy that hides memory latency."""
    threads = 32 * compiled.metadata.num_warps
    by_registers = 65536 // (-(-registers // 8) * 8 * threads)
    shared = compiled.metadata.shared
    by_shared = SHARED_MEMORY.get(arch, 0) // shared if shared else by_registers
    return min(by_registers, by_shared)


def _usage(compiled, arch: int) -> str:
    """", registers R, stack S B, local L B, wgmma W, mma.sync M, N blocks a multiprocessor" (resources,
    _tensor_cores, blocks_per_multiprocessor); the tensor cores' part alone where cuobjdump is missing."""
    found = resources(compiled)
    if found is None:
        return _tensor_cores(compiled)
    return (f", registers {found[0]}, stack {found[1]} B, local {found[2]} B{_tensor_cores(compiled)}, "
            f"{blocks_per_multiprocessor(compiled, found[0], arch)} blocks a multiprocessor")


def _loop(sass: str) -> Optional[list]:
    """The instructions of a kernel's loops in cuobjdump's SASS (`loop_code`), each (address, opcode, branch target
    or None, whether the branch may fall through: predicated, or a divergence branch); None without a loop."""
    code = []
    for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass):
        words = text.split()
        op = words[1] if words[0].startswith("@") else words[0]  # (after a predicate, @P0 or @!P1)
        target = re.search(r"0x([0-9a-f]+)", text) if op.split(".")[0] == "BRA" else None
        code.append((int(address, 16), op, int(target[1], 16) if target else None,
                     words[0].startswith("@") or op != "BRA"))
    end_of_kernel = max((address for address, op, *_ in code if op == "EXIT"), default=float("inf"))
    back = [(target, address) for address, _, target, _ in code
            if target is not None and target < address < end_of_kernel]
    if not back:
        return None
    start, end = min(target for target, _ in back), max(address for _, address in back)
    return [instruction for instruction in code if start <= instruction[0] <= end]


def loop_code(sass: str) -> Optional[Tuple[int, int, int]]:
    """(instructions, special-function ones, barriers) in the code of a kernel's loops in cuobjdump's SASS: from the
    lowest address a backward branch jumps to up to the last backward branch before the kernel's last EXIT (a loop's
    latch), every branch inside counted (an iteration runs one path through them: `loop_paths`); None where the
    kernel has no loop. The code between the loops and that EXIT (the epilogue) is not counted, nor the blocks
    ptxas places after it that branch back into a loop (the warp-divergence paths of its reductions, which a
    converged warp never takes). A thread issues each of them once an iteration, so for a loop whose tile products
    are few (Hopper's wgmma) they are what an iteration costs to issue; the special-function units (MUFU:
    exponentials, reciprocals, square roots) issue 16 a clock a multiprocessor, an eighth of the float32 units' rate;
    at a barrier (BAR: shared memory's exchanges between warps, a reduction's or a layout's) every warp of the block
    waits for the others."""
    loop = _loop(sass)
    if loop is None:
        return None
    ops = [op for _, op, *_ in loop]
    return len(ops), sum(op.startswith("MUFU") for op in ops), sum(op.split(".")[0] == "BAR" for op in ops)


def loop_paths(sass: str) -> Optional[Tuple[int, int]]:
    """The fewest and the most instructions an iteration of `loop_code`'s loops issues: its paths from the loop's
    first instruction to its latch, along fall-throughs and forward branches (a branch out of the loop ends no path
    there, a backward one falls through). Paths that no iteration takes count too (two tests of one condition: a
    tile's mask, then its sums), so the range bounds what iterations issue; in the bidirectional kernels the fewest
    are a factored tile's, the most a tile's whose mask is made entry by entry."""
    loop = _loop(sass)
    if loop is None:
        return None
    index = {address: at for at, (address, *_) in enumerate(loop)}
    fewest, most = [None] * len(loop), [None] * len(loop)
    fewest[0] = most[0] = 1
    for at, (address, op, target, falls) in enumerate(loop):
        if fewest[at] is None:
            continue
        following = [at + 1] if (target is None or falls or target <= address) and at + 1 < len(loop) else []
        if target is not None and target > address and target in index:
            following.append(index[target])
        for then in following:
            fewest[then] = min(fewest[then] or 1 << 30, fewest[at] + 1)
            most[then] = max(most[then] or 0, most[at] + 1)
    return fewest[-1], most[-1]


def _loop_issue(compiled) -> str:
    """", loop I instructions (MUFU M, BAR B), an iteration F-M" (`loop_code`, `loop_paths` of the cubin's SASS);
    "" where cuobjdump is missing or there is no loop."""
    sass = _cuobjdump(compiled, "-sass") or ""
    found, paths = loop_code(sass), loop_paths(sass)
    return (f", loop {found[0]} instructions (MUFU {found[1]}, BAR {found[2]}), an iteration {paths[0]}-{paths[1]}"
            if found else "")


def for_target(kwargs: dict, arch: int) -> dict:
    """A recorded launch's keyword arguments as the code launches it on that target: the bidirectional forward's
    register cap (maxnreg) only on the architectures it is set for (the interpreter's launches record it)."""
    from lion_vit.ops.triton.bidirectional import REGISTER_CAP_ARCHITECTURES
    return kwargs if arch // 10 in REGISTER_CAP_ARCHITECTURES else {k: v for k, v in kwargs.items() if k != "maxnreg"}


def rebuilt(value):
    """A recorded argument as the compiler takes it: a tensor described by dtype and alignment ({"tensor": ...,
    "aligned": ...}) as a small tensor of that dtype, aligned to 16 bytes or not; anything else as it is."""
    import torch
    if isinstance(value, dict):
        tensor = torch.empty(8, dtype=getattr(torch, value["tensor"]))
        return tensor if value["aligned"] else tensor[1:]
    return value


def compile_all(launches, archs, loops: bool = False) -> Tuple[int, int]:
    """Compiles each launch (`to_compile`'s) for each target; prints a line each (with loops, its loops' code:
    `loop_code`); returns how many compiled and how many were tried."""
    import importlib

    from triton.runtime import driver

    failures = 0
    for arch in archs:  # (the last target stays the active driver: a machine without a GPU has no other)
        driver.set_active(_Target(arch))
        for launch in launches:
            module, name, args, kwargs = launch
            kwargs = for_target(kwargs, arch)
            flags = " ".join(f"{key}={value}" for key, value in kwargs.items()
                             if key.isupper() or key in ("num_warps", "maxnreg"))
            what = f"sm_{arch} {name} {_dtype(launch)} {flags}"
            kernel = getattr(importlib.import_module(module), name)
            try:
                compiled = kernel.warmup(*map(rebuilt, args), grid=(1,), **{k: rebuilt(v) for k, v in kwargs.items()})
                shared, limit = compiled.metadata.shared, SHARED_MEMORY.get(arch, float("inf"))
                if shared > limit:  # (a launch would raise OutOfResources)
                    raise RuntimeError(f"needs {shared} B of shared memory, sm_{arch} has {limit} B per block")
            except Exception as error:  # the compiler's error, whatever its class: reported, not raised
                failures += 1
                print(f"FAIL {what}\n  {type(error).__name__}: {str(error).strip()}", flush=True)
            else:
                print(f"ok   {what}  shared {shared} B{_usage(compiled, arch)}"
                      f"{_loop_issue(compiled) if loops else ''}", flush=True)
    total = len(launches) * len(archs)
    return total - failures, total


def recorded_in_child(script: str, path: str, knobs: dict, *options: str) -> bool:
    """Runs `script` again as its recording child (--record-to path --knobs ..., and the options given) under
    Triton's interpreter, which is on there and off here, where the compiler runs; False where it failed."""
    child = [sys.executable, script, "--record-to", path, "--knobs", json.dumps(knobs), *options]
    return subprocess.run(child, env=dict(os.environ, TRITON_INTERPRET="1")).returncode == 0


def child_knobs(text: str) -> dict:
    """The recording child's --knobs: the parent's Tuning settings as JSON, which has lists where the launch
    settings are tuples."""
    return {name: tuple(value) if isinstance(value, list) else value for name, value in json.loads(text).items()}


def outside_the_interpreter(main, script: str) -> int:
    """A script's exit status from main(): run here, or, where TRITON_INTERPRET is set and this is not the
    recording child, in a copy of the process without it (the compiler, not the interpreter)."""
    if not os.environ.get("TRITON_INTERPRET") or "--record-to" in sys.argv:
        return main()
    return subprocess.run([sys.executable, script, *sys.argv[1:]],
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80],
                        help="compute capabilities to compile for (90: H100/H200, 80: A100)")
    parser.add_argument("--quick", action="store_true", help="record fewer calls and compile each setting of each "
                        "kernel's flags once (bfloat16 where 16-bit), each kernel also in float32 and float16")
    parser.add_argument("--records", help="compile the launches in this JSON file instead of recording them")
    parser.add_argument("--save-records", metavar="FILE", help="record the launches into FILE and stop, for "
                        "another Triton to compile with --records (a GPU machine's version, on PYTHONPATH)")
    for which in ("forward", "backward"):
        parser.add_argument(f"--bidirectional-{which}", type=launch_setting, metavar="O,L,W",
                            help=f"record the bidirectional {which} kernel{'s' if which == 'backward' else ''} in "
                                 f"this launch setting (own,loop,warps; lion_vit.ops.Tuning), not the code's")
    parser.add_argument("--bidirectional-forward-uncapped", action="store_true",
                        help="record the bidirectional forward kernel with its registers as ptxas allots them, not "
                             "capped to fit Tuning.bidirectional_forward_blocks blocks a multiprocessor")
    orientation = parser.add_mutually_exclusive_group()
    orientation.add_argument("--bidirectional-keys-first", action="store_true",
                             help="record the bidirectional backward's key kernel with its tiles [keys, queries] "
                                  "(Tuning.bidirectional_keys_first on)")
    orientation.add_argument("--bidirectional-queries-first", action="store_true",
                             help="record it with its tiles [queries, keys], as the other kernels' "
                                  "(Tuning.bidirectional_keys_first off)")
    parser.add_argument("--bidirectional-entrywise-masks", action="store_true",
                        help="record the bidirectional kernels with an exponential for every mask entry, no tile "
                             "factored (Tuning.bidirectional_factored_masks off)")
    parser.add_argument("--bidirectional-maps-in-loops", action="store_true",
                        help="record the bidirectional kernels mapping every tile of q and k as they read it, with "
                             "no map pass before them (Tuning.bidirectional_map_pass off)")
    parser.add_argument("--loops", action="store_true",
                        help="also count the instructions of each kernel's loops in its SASS (cuobjdump; about 0.3 "
                             "s a launch), special-function ones and barriers apart: what an iteration costs to "
                             "issue")
    parser.add_argument("--record-to", help=argparse.SUPPRESS)  # the recording child process
    parser.add_argument("--knobs", type=child_knobs, default={}, help=argparse.SUPPRESS)  # and its parent's knobs
    args = parser.parse_args(argv)
    if args.record_to:
        Path(args.record_to).write_text(json.dumps(recorded_launches(args.quick, args.knobs)))
        return 0
    knobs = {f"bidirectional_{which}": getattr(args, f"bidirectional_{which}") for which in ("forward", "backward")
             if getattr(args, f"bidirectional_{which}") is not None}
    if args.bidirectional_forward_uncapped:
        knobs["bidirectional_forward_blocks"] = 0
    if args.bidirectional_keys_first or args.bidirectional_queries_first:
        knobs["bidirectional_keys_first"] = args.bidirectional_keys_first
    if args.bidirectional_entrywise_masks:
        knobs["bidirectional_factored_masks"] = False
    if args.bidirectional_maps_in_loops:
        knobs["bidirectional_map_pass"] = False
    if args.records is None:  # recorded in a child process: the interpreter is on there, off here
        with tempfile.TemporaryDirectory() as folder:
            path = args.save_records or str(Path(folder) / "launches.json")
            if not recorded_in_child(__file__, path, knobs, *(["--quick"] if args.quick else [])):
                print("compile_kernels: recording the launches under Triton's interpreter failed (above)")
                return 1
            launches = json.loads(Path(path).read_text())
        if args.save_records:
            print(f"{len(launches)} launches recorded into {path}")
            return 0
    else:
        try:
            launches = json.loads(Path(args.records).read_text())
        except (OSError, ValueError) as error:
            print(f"compile_kernels: cannot read --records {args.records} ({error}); give a JSON file that this "
                  "script's recording wrote, or leave --records out to record the launches here")
            return 2
    compiled, total = compile_all(to_compile(launches, args.quick), args.arch, loops=args.loops)
    print(f"{compiled} of {total} launches compiled for " + ", ".join(f"sm_{a}" for a in args.arch))
    return 0 if compiled == total else 1


if __name__ == "__main__":
    sys.exit(outside_the_interpreter(main, __file__))
