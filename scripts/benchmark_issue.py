"""What the bidirectional kernels' loops cost to issue per pair of tokens, against softmax attention's kernels
compiled the same way, on a machine without a GPU.

On Hopper the bidirectional kernels' loops are bound by issuing their instructions more than by their tensor-core
products (docs/benchmarks.md, "Kernels compiled without a GPU"). This script records the launches of a training
step of the fused attention form under Triton's interpreter (silu_norm features, the sum scaling, 16-bit q, k, v:
the models' defaults; compile_kernels.py's recording), compiles the forward kernel and the backward's key and query
kernels in bfloat16 for the target, and counts the instructions of an iteration of each kernel's loop in its SASS
(compile_kernels.loop_paths: the fewest, a tile whose mask factors, to the most, one made entry by entry), times its
warps, over the tile's pairs of tokens. Beside each it compiles softmax attention's kernel of the same role
(below: a flash kernel of the structure of Triton's fused-attention tutorial) with the same tiles,
warps and width, and prints the ratio: the proxy, in the same run, of the fused attention form's time against
DeiT's attention (PyTorch's SDPA runs FlashAttention-2 or cuDNN there, not this kernel; issue #56's targets are
measured on a GPU: gpu_check.sh's `fused` part).

    python scripts/benchmark_issue.py                                  # sm_90, the code's launch settings
    python scripts/benchmark_issue.py --bidirectional-backward 32,32,4 # another backward setting (own,loop,warps)
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import compile_kernels  # noqa: E402
from benchmarking import launch_setting  # noqa: E402
from lion_vit.ops.triton.operands import CONTRACTED  # noqa: E402  (compiled as the kernels it stands beside)

# the decay kind and scans of a training step's launches: a decay per token launches the same kernels as one per head
MODELS = {"LION-d, LION-s": ("fixed", 1), "LION-d/s-natural": ("fixed", 2)}
KERNELS = {"_forward_kernel": ("forward", "softmax_forward_kernel"),
           "_backward_keys_kernel": ("keys", "softmax_keys_kernel"),
           "_backward_queries_kernel": ("queries", "softmax_queries_kernel")}

# Softmax attention as a flash kernel in Triton, the baseline: not what PyTorch's SDPA runs on a GPU
# (FlashAttention-2 or cuDNN) but the structure of Triton's fused-attention tutorial (an online softmax forward; a
# backward of a program per key tile for dk, dv and one per query tile for dq, no atomics, as the bidirectional
# kernels' backward), without its causal mask, for any length L (keys past L masked in the forward's last tile,
# rows past L zero). q, k, v (strides si*: views of one projection, as a ViT's) and o, dO and the gradients (so*)
# are [B, H, L, D] with the last dimension contiguous; M (the rows' log2-sum-exp) and delta (rowsum(dO * O)) are
# contiguous [B * H, LP], LP a multiple of every tile past L, zero there, read without masks (as FlashAttention-2
# rounds its rows' sums up, and the bidirectional kernels pad their per-token vectors).


@triton.jit
def _rows(x, b, h, t, ok, sb, sh, sl, D: tl.constexpr):
    return tl.load(x + b * sb + h * sh + t[:, None] * sl + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _store_rows(x, value, b, h, t, ok, sb, sh, sl, D: tl.constexpr):
    tl.store(x + b * sb + h * sh + t[:, None] * sl + tl.arange(0, D)[None, :], value.to(x.dtype.element_ty),
             mask=ok[:, None])


@triton.jit
def softmax_forward_kernel(q, k, v, o, M, sib, sih, sil, sob, soh, sol, L, LP, H, scale, D: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program per query tile over every key tile: the online softmax's running max and sum in registers."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < L
    q_tile = _rows(q, b, h, rows, row_ok, sib, sih, sil, D)
    top = tl.full([BLOCK_M], -float("inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    scale2 = scale * 1.4426950408889634  # (exp2)
    for start in range(0, L, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        k_tile, v_tile = _rows(k, b, h, cols, col_ok, sib, sih, sil, D), _rows(v, b, h, cols, col_ok, sib, sih, sil, D)
        s = tl.dot(q_tile, tl.trans(k_tile)) * scale2
        if start + BLOCK_N > L:  # (the last tile only)
            s = tl.where(col_ok[None, :], s, -1.0e30)
        new_top = tl.maximum(top, tl.max(s, 1))
        p = tl.math.exp2(s - new_top[:, None])
        alpha = tl.math.exp2(top - new_top)
        total = total * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None])
        top = new_top
    _store_rows(o, acc / total[:, None], b, h, rows, row_ok, sob, soh, sol, D)
    tl.store(M + bh.to(tl.int64) * LP + rows, top + tl.math.log2(total), mask=row_ok)


@triton.jit
def softmax_keys_kernel(q, k, v, do, M, delta, dk, dv, sib, sih, sil, sob, soh, sol, L, LP, H, scale,
                        D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program per key tile (BLOCK_N keys) over every query tile (BLOCK_M): dk, dv; tiles [keys, queries]."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < L
    k_tile, v_tile = _rows(k, b, h, cols, col_ok, sib, sih, sil, D), _rows(v, b, h, cols, col_ok, sib, sih, sil, D)
    dk_acc = tl.zeros([BLOCK_N, D], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, D], tl.float32)
    scale2 = scale * 1.4426950408889634
    for start in range(0, L, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < L
        q_tile = _rows(q, b, h, rows, row_ok, sib, sih, sil, D)
        do_tile = _rows(do, b, h, rows, row_ok, sob, soh, sol, D)
        at = bh.to(tl.int64) * LP + rows
        m, d = tl.load(M + at), tl.load(delta + at)
        p = tl.math.exp2(tl.dot(k_tile, tl.trans(q_tile)) * scale2 - m[None, :])
        dv_acc += tl.dot(p.to(do_tile.dtype), do_tile)
        ds = p * (tl.dot(v_tile, tl.trans(do_tile)) - d[None, :])
        dk_acc += tl.dot(ds.to(q_tile.dtype), q_tile)
    _store_rows(dk, dk_acc * scale, b, h, cols, col_ok, sob, soh, sol, D)
    _store_rows(dv, dv_acc, b, h, cols, col_ok, sob, soh, sol, D)


@triton.jit
def softmax_queries_kernel(q, k, v, do, M, delta, dq, sib, sih, sil, sob, soh, sol, L, LP, H, scale,
                           D: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program per query tile (BLOCK_M queries) over every key tile (BLOCK_N): dq."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < L
    q_tile, do_tile = _rows(q, b, h, rows, row_ok, sib, sih, sil, D), _rows(do, b, h, rows, row_ok, sob, soh, sol, D)
    at = bh.to(tl.int64) * LP + rows
    m, d = tl.load(M + at), tl.load(delta + at)
    dq_acc = tl.zeros([BLOCK_M, D], tl.float32)
    scale2 = scale * 1.4426950408889634
    for start in range(0, L, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        k_tile, v_tile = _rows(k, b, h, cols, col_ok, sib, sih, sil, D), _rows(v, b, h, cols, col_ok, sib, sih, sil, D)
        p = tl.math.exp2(tl.dot(q_tile, tl.trans(k_tile)) * scale2 - m[:, None])
        ds = p * (tl.dot(do_tile, tl.trans(v_tile)) - d[:, None])
        dq_acc += tl.dot(ds.to(k_tile.dtype), k_tile)
    _store_rows(dq, dq_acc * scale, b, h, rows, row_ok, sob, soh, sol, D)


def softmax_attention(q, k, v, forward=(16, 16, 1), backward=(16, 16, 1)):
    """Softmax attention of q, k, v [B, H, L, D] (of one stride, as views of one projection) through the kernels,
    differentiable, in launch settings (own tile, loop tile, warps) forward and backward as the bidirectional
    kernels': what it stands for checked under the interpreter (tests/test_triton.py), timed on a GPU
    (benchmark_fused.py)."""

    tile = max(*forward[:2], *backward[:2])

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            batch, heads, length, width = q.shape
            padded = triton.cdiv(length, tile) * tile
            o = q.new_empty(batch, heads, length, width)
            M = q.new_zeros(batch * heads, padded, dtype=torch.float32)
            own, loop, warps = forward
            softmax_forward_kernel[(triton.cdiv(length, own), batch * heads)](
                q, k, v, o, M, *q.stride()[:3], *o.stride()[:3], length, padded, heads, width ** -0.5, D=width,
                BLOCK_M=own, BLOCK_N=loop, num_warps=warps, **CONTRACTED)
            ctx.save_for_backward(q, k, v, o, M)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, M = ctx.saved_tensors
            batch, heads, length, width = q.shape
            padded = M.shape[1]
            do = do.contiguous()
            delta = torch.zeros_like(M)
            delta[:, :length] = (do.float() * o.float()).sum(-1).reshape(batch * heads, length)
            dq, dk, dv = (torch.empty_like(o) for _ in "qkv")
            own, loop, warps = backward
            shared = (*q.stride()[:3], *o.stride()[:3], length, padded, heads, width ** -0.5)
            softmax_keys_kernel[(triton.cdiv(length, own), batch * heads)](
                q, k, v, do, M, delta, dk, dv, *shared, D=width, BLOCK_M=loop, BLOCK_N=own, num_warps=warps,
                **CONTRACTED)
            softmax_queries_kernel[(triton.cdiv(length, own), batch * heads)](
                q, k, v, do, M, delta, dq, *shared, D=width, BLOCK_M=own, BLOCK_N=loop, num_warps=warps, **CONTRACTED)
            return dq, dk, dv

    if not (q.stride() == k.stride() == v.stride() and q.stride(-1) == 1):
        q, k, v = (x.contiguous() for x in (q, k, v))
    return Attention.apply(q, k, v)


def record(knobs: dict) -> dict:
    """Each model's launches of the three kernels in a training step, recorded under the interpreter (in float16:
    its numpy has no bfloat16; compiled in bfloat16)."""
    launches = {}
    for model, (decay, scans) in MODELS.items():
        thunk = partial(compile_kernels.call, torch.float16, decay, scans, "attention", "silu_norm", True)
        launches[model] = [launch for launch in compile_kernels.recorded_launches(False, knobs, [thunk])
                           if launch[1] in KERNELS]
    return launches


def issue(compiled, arch: int, warps: int, pairs: int) -> dict:
    """Registers, blocks a multiprocessor and an iteration's instructions (fewest, most), per pair of tokens too."""
    usage = compile_kernels.resources(compiled)
    paths = compile_kernels.loop_paths(compile_kernels._cuobjdump(compiled, "-sass") or "")
    if usage is None or paths is None:
        raise RuntimeError("no loop in the SASS (or no cuobjdump: Triton's Linux x86-64 wheels bring one)")
    return dict(registers=usage[0], blocks=compile_kernels.blocks_per_multiprocessor(compiled, usage[0], arch),
                iteration=paths, per_pair=tuple(count * warps / pairs for count in paths))


def measure(launches: dict, arch: int) -> list:
    """A row per model and kernel: ours and softmax's of the same role, tiles and warps."""
    from triton.runtime import driver

    driver.set_active(compile_kernels._Target(arch))
    rows = []
    for model, recorded in launches.items():
        for launch in recorded:
            module, name, args, kwargs = list(compile_kernels._variants(launch))[-1]  # (bfloat16)
            kwargs = compile_kernels.for_target(kwargs, arch)
            kernel = getattr(importlib.import_module(module), name)
            ours = kernel.warmup(*map(compile_kernels.rebuilt, args), grid=(1,),
                                 **{k: compile_kernels.rebuilt(v) for k, v in kwargs.items()})
            tiles, warps, width = (kwargs["BLOCK_M"], kwargs["BLOCK_N"]), kwargs["num_warps"], kwargs["BLOCK_K"]
            role, baseline = KERNELS[name]
            pointer, sums = torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.float32)
            # q, k, v: views of a projection [B, L, 3, H, D] (ViT-S: 6 heads, 197 tokens); o, gradients [B, H, L, D]
            strides = (197 * 3 * 384, 64, 3 * 384, 6 * 197 * 64, 197 * 64, 64)
            operands = dict(forward=[pointer] * 4 + [sums], keys=[pointer] * 4 + [sums] * 2 + [pointer] * 2,
                            queries=[pointer] * 4 + [sums] * 2 + [pointer])[role]
            theirs = globals()[baseline].warmup(
                *operands, *strides, 197, 256, 6, 0.125, grid=(1,), D=width, BLOCK_M=tiles[0], BLOCK_N=tiles[1],
                num_warps=warps)
            pairs = tiles[0] * tiles[1]
            rows.append(dict(model=model, kernel=role, tiles=tiles, warps=warps, scans=kwargs["SCANS"],
                             ours=issue(ours, arch, warps, pairs), softmax=issue(theirs, arch, warps, pairs)))
    return rows


def table(rows: list, arch: int) -> str:
    """The rows as markdown, and each model's forward and backward per pair against softmax's."""
    span = lambda pair, digits=2: f"{pair[0]:.{digits}f}-{pair[1]:.{digits}f}"  # noqa: E731
    lines = [f"sm_{arch}, bfloat16: an iteration's instructions (fewest-most), x warps / the tile's pairs of tokens",
             "", "| model | kernel | tiles, warps | registers, blocks | iteration | per pair | softmax's per pair | "
             "x softmax |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ours, theirs = row["ours"], row["softmax"]
        ratio = tuple(o / theirs["per_pair"][0] for o in ours["per_pair"])
        lines.append(f"| {row['model']} | {row['kernel']} | {row['tiles'][0]}x{row['tiles'][1]}, {row['warps']} | "
                     f"{ours['registers']}, {ours['blocks']} ({theirs['registers']}, {theirs['blocks']}) | "
                     f"{span(ours['iteration'], 0)} | {span(ours['per_pair'])} | {span(theirs['per_pair'])} | "
                     f"x{span(ratio)} |")
    lines.append("")
    for model in dict.fromkeys(row["model"] for row in rows):
        for part, roles in (("forward", ("forward",)), ("backward", ("keys", "queries"))):
            picked = [row for row in rows if row["model"] == model and row["kernel"] in roles]
            ours = tuple(sum(row["ours"]["per_pair"][end] for row in picked) for end in (0, 1))
            theirs = sum(row["softmax"]["per_pair"][0] for row in picked)
            lines.append(f"{model} {part}: {span(ours)} per pair, softmax's {theirs:.2f}: "
                         f"x{ours[0] / theirs:.2f}-{ours[1] / theirs:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="the compute capability to compile for (90: Hopper)")
    for which in ("forward", "backward"):
        parser.add_argument(f"--bidirectional-{which}", type=launch_setting, metavar="O,L,W",
                            help=f"the bidirectional {which} launch setting (own,loop,warps), not the code's")
    parser.add_argument("--out", help="also write the rows as JSON to this file")
    parser.add_argument("--record-to", help=argparse.SUPPRESS)  # the recording child process
    parser.add_argument("--knobs", type=compile_kernels.child_knobs, default={}, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record_to:
        Path(args.record_to).write_text(json.dumps(record(args.knobs)))
        return 0
    if compile_kernels.nvidia_tool("cuobjdump") is None:
        print("benchmark_issue: no cuobjdump to read the kernels' SASS with (Triton's Linux x86-64 wheels bring "
              "one, as TRITON_CUOBJDUMP_PATH names another); install Triton from such a wheel")
        return 2
    knobs = {f"bidirectional_{which}": getattr(args, f"bidirectional_{which}") for which in ("forward", "backward")
             if getattr(args, f"bidirectional_{which}") is not None}
    with tempfile.TemporaryDirectory() as folder:  # recorded in a child: the interpreter is on there, off here
        path = Path(folder) / "launches.json"
        if not compile_kernels.recorded_in_child(__file__, str(path), knobs):
            print("benchmark_issue: recording the launches under Triton's interpreter failed (above)")
            return 1
        launches = json.loads(path.read_text())
    rows = measure(launches, args.arch)
    print(table(rows, args.arch))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(compile_kernels.outside_the_interpreter(main, __file__))
