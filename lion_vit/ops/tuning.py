"""The ops' tuning knobs in one place: their defaults (what timings chose, docs/benchmarks.md) and `tuned`,
which sets some for a block of code, as scripts do to time other settings.

    from lion_vit.ops import tuned
    with tuned(chunk_backward_fallback="rnn", group_share=0.5):
        model(images)

dispatch.plan reads them as it plans a call (a compiled graph as it is traced: a change later is a new trace),
the Triton backend as it launches a kernel (a backward run after the block launches with the settings then).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Dict, Iterator, Mapping, Optional, Tuple

# What trains in the chunk form where flash-linear-attention's chunk backward fails (Hopper with Triton
# 3.4.0-3.7.0): Tuning.chunk_backward_fallback's choices.
CHUNK_BACKWARD_FALLBACKS = {"torch": "the portable chunk form", "rnn": "its fused recurrent kernels",
                            "forward": "the chunk kernels with a backward of their forward passes"}

LaunchSetting = Tuple[int, int, int]


def _auto_chunk_min_tokens() -> Dict[Tuple[bool, int], int]:
    return {(False, 1): 3136, (False, 2): 3136, (True, 1): 1024, (True, 2): 1024}


def _cpu_auto_chunk_min_tokens() -> Dict[Tuple[bool, int], int]:
    return {(False, 1): 400, (False, 2): 400, (True, 1): 784, (True, 2): 784}


# The knobs that give a number of tokens by (training, number of scans): form "auto"'s thresholds.
THRESHOLD_KNOBS = {"auto_chunk_min_tokens": _auto_chunk_min_tokens,
                   "cpu_auto_chunk_min_tokens": _cpu_auto_chunk_min_tokens}


@dataclass(frozen=True, eq=False)
class Tuning:
    """The knobs; each changes speed or memory, never the function computed.

    auto_chunk_min_tokens: form "auto" on the triton backend runs the chunk kernels from this many tokens on (896
        px at patch 16 has 3,136 patches, and a class token where the model has one), the attention form below,
        by (training, number of scans: 1, or 2 for two and more). Inference: the smallest length timed at which the
        kernels win (the inference part of `make gpu-check`); training: a guess until the forms part has timed both
        forms from 576 to 3,136 tokens.
    cpu_auto_chunk_min_tokens: form "auto" on a CPU (the torch backend) runs the chunk form from this many tokens on,
        the attention form below, by (training, number of scans, as above): the smallest length timed on a 2-core CPU
        from which no small model took clearly more time in the chunk form, and each less memory (400 tokens, 320 px, in
        inference; 784, 448 px, in training; docs/benchmarks.md, "Form auto on a CPU").
    default_chunk_size: the most tokens a chunk holds where the call names no chunk size: the chunk form off the
        triton backend (whose kernels chunk by their own tile), and form "auto" where it runs the chunk form on a
        CPU. (Without it a chunk form would run one chunk of the whole sequence: the attention form's cost.)
    chunk_backward_fallback: training in the chunk form where FLA's chunk backward fails: "torch" (the portable
        chunk form, parallel over chunks), "rnn" (FLA's fused recurrent kernels, serial over tokens) or "forward"
        (the chunk kernels, whose backward runs as three more of their forward passes): the fastest of the three
        where the fallback part of `make gpu-check` timed them.
    chunk_backward_fails: None (detected: Hopper GPUs with Triton 3.4.0-3.7.0, fla-org/flash-linear-attention#640),
        or True / False to plan as if FLA's chunk backward did or did not fail here.
    group_share: inference on the triton backend runs the batch in groups of images whose kernel buffers take at
        most this share of the batch's |q| + |k| + |v|: at 4/3 a layer's attention holds no more than a ViT MLP's
        hidden activations (docs/benchmarks.md, "Peak"); 0 runs one image a group.
    recurrent_group_programs: FLA's recurrent kernel takes one program's time whatever the number of its programs,
        up to one on every multiprocessor, so its groups hold at least the images that give this many programs
        (None: the GPU's multiprocessors; 1 on other devices).
    bidirectional_forward, bidirectional_backward: the bidirectional kernel's launch settings (tokens of a
        program's own tile, tokens per tile of its loop, warps), forward and for both backward kernels; tiles are
        powers of two of at least 16 tokens (tl.dot), warps a power of two. The backward's 4 warps until a GPU has
        timed them: compiled for Hopper, 8 warps issue about as much a thread as 4 for the same tiles, part of the
        work done by both warpgroups (docs/benchmarks.md, "Kernels compiled without a GPU").
    bidirectional_forward_blocks: the bidirectional forward kernel's registers are capped so that this many of its
        blocks fit a multiprocessor's 64 K registers at once, in launches on 16-bit q, k, v with float32 sums (below
        FLOAT64_EXPONENTS_ABOVE tokens) on Hopper (an A100's capped forward spills); 0: as many as ptxas' own
        allotment lets fit. 3 (of 4 warps: 168 registers a thread) until a GPU has timed both: uncapped, the GPU
        machine's Triton fits 2, and capped its bfloat16 launches spill nothing; float32 tiles and float64 sums,
        which would spill, stay uncapped (docs/benchmarks.md, "Kernels compiled without a GPU").
    bidirectional_keys_first: the backward's key kernel computes its tiles as [keys, queries], so that every
        product spans its own keys (on Hopper, wgmma where [queries, keys] runs its products of the loop's query
        tiles as mma.sync), rather than [queries, keys] as the other kernels do. On until a GPU has timed both:
        with the backward's 4 warps it issues less and spills nothing in 16-bit launches (docs/benchmarks.md,
        "Kernels compiled without a GPU").
    bidirectional_factored_masks: the bidirectional kernels make a mask tile whose keys all come before its queries
        along the scan (or all after them) as the outer product of a vector over its queries and one over its keys,
        an exponential per token, rather than one per entry as the tiles that hold both (ops/triton/bidirectional.py).
        On until a GPU has timed both: less arithmetic for as many blocks a multiprocessor in the training launches
        (sm_90; docs/benchmarks.md, "Factored mask tiles").
    bidirectional_map_pass: a pass of ours maps k just before the bidirectional forward kernel (q and k before the
        backward's), which reads those features as given, rather than raw rows that each program maps as it reads a
        tile of its loop (every key tile once per query tile: 4 times forward at 197 tokens in tiles of 64). The
        features are dropped after the launch and made again for backward, whose kernels read the raw rows of their
        own tiles for the map's gradient, so nothing more is kept. The same bits. On until a GPU has timed both:
        the loops' SASS issues a third to two fifths less forward and a tenth to a sixth less backward, for a pass
        over k (q and k) that writes each once (docs/benchmarks.md, "Kernels compiled without a GPU").
    linear_kernels: LION-lit's attention form (and its chunk form, one product) on the triton backend runs two kernels
        of ours (ops/triton/linear.py), which map q and k as they read them and write nothing but Y and a state per
        head, rather than Q (K^T V) in torch matmuls with each elementwise step around them a pass over memory. On
        until a GPU has timed both (benchmark_fused.py's lion_lit rows; the CPU traffic proxy: docs/benchmarks.md,
        "LION-lit's linear kernels").
    grid_axis_limit: the most program rows a kernel launch may have on its grid's second or third axis: CUDA's
        65,535. The triton backend's kernels (FLA's too) put images x sequences x heads there, so a batch that
        would pass it runs in parts (dispatch.implementation); tests lower it to run parts at small sizes.
    normaliser_launch: the normaliser scan's launch settings on the triton backend (ops/triton/normaliser.py): tokens
        per chunk and program (a power of two of at least 16: tl.dot), chunk sums a carry reads at a time (a power
        of two) and warps (scripts/benchmark_normaliser.py times others on a GPU). Read by the forward; its
        backward launches the same, since it reuses the forward's chunk sums.
    """

    auto_chunk_min_tokens: Dict[Tuple[bool, int], int] = field(default_factory=_auto_chunk_min_tokens)
    cpu_auto_chunk_min_tokens: Dict[Tuple[bool, int], int] = field(default_factory=_cpu_auto_chunk_min_tokens)
    default_chunk_size: int = 64
    chunk_backward_fallback: str = "forward"
    chunk_backward_fails: Optional[bool] = None
    group_share: float = 4 / 3
    recurrent_group_programs: Optional[int] = None
    bidirectional_forward: LaunchSetting = (64, 64, 4)
    bidirectional_backward: LaunchSetting = (64, 32, 4)
    bidirectional_forward_blocks: int = 3
    bidirectional_keys_first: bool = True
    bidirectional_factored_masks: bool = True
    bidirectional_map_pass: bool = True
    linear_kernels: bool = True
    grid_axis_limit: int = 65535
    normaliser_launch: LaunchSetting = (64, 16, 4)

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_backward_fallback, str) or \
                self.chunk_backward_fallback not in CHUNK_BACKWARD_FALLBACKS:
            raise ValueError(f"unknown chunk_backward_fallback {self.chunk_backward_fallback!r}; choose one of "
                             f"{sorted(CHUNK_BACKWARD_FALLBACKS)}")
        for name in ("bidirectional_keys_first", "bidirectional_factored_masks", "bidirectional_map_pass",
                     "linear_kernels"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.chunk_backward_fails not in (None, True, False):
            raise ValueError(f"chunk_backward_fails must be None (detect), True or False, got "
                             f"{self.chunk_backward_fails!r}")
        for name, default in THRESHOLD_KNOBS.items():
            thresholds = getattr(self, name)
            if not isinstance(thresholds, Mapping) or sorted(thresholds) != sorted(default()) or \
                    not all(_positive_int(tokens) for tokens in thresholds.values()):
                raise ValueError(f"{name} must give a positive number of tokens for each of {sorted(default())} "
                                 f"(training, scans), got {thresholds!r}")
            object.__setattr__(self, name, dict(thresholds))  # (a copy: not the caller's dict)
        if not _positive_int(self.default_chunk_size):
            raise ValueError(f"default_chunk_size must be a positive integer, got {self.default_chunk_size!r}")
        if isinstance(self.group_share, bool) or not isinstance(self.group_share, (int, float)) or \
                not self.group_share >= 0:
            raise ValueError(f"group_share must be a number >= 0 (0: one image a group), got {self.group_share!r}")
        if not _positive_int(self.grid_axis_limit):
            raise ValueError(f"grid_axis_limit must be a positive integer (CUDA's: 65535), got "
                             f"{self.grid_axis_limit!r}")
        if not (self.bidirectional_forward_blocks == 0 or _positive_int(self.bidirectional_forward_blocks)) or \
                isinstance(self.bidirectional_forward_blocks, bool):
            raise ValueError(f"bidirectional_forward_blocks must be a positive integer, or 0 (registers as ptxas "
                             f"allots them), got {self.bidirectional_forward_blocks!r}")
        if self.recurrent_group_programs is not None and not _positive_int(self.recurrent_group_programs):
            raise ValueError(f"recurrent_group_programs must be a positive integer or None (the GPU's "
                             f"multiprocessors), got {self.recurrent_group_programs!r}")
        for name in ("bidirectional_forward", "bidirectional_backward"):
            object.__setattr__(self, name, check_launch_setting(getattr(self, name), name))
        object.__setattr__(self, "normaliser_launch", check_launch_setting(
            self.normaliser_launch, "normaliser_launch", NORMALISER_PARTS, least=(16, 1), example=(64, 16, 4)))

    def changes(self) -> Dict[str, object]:
        """The knobs set to other values than their defaults, by name."""
        default = Tuning()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _power_of_two(value: object, least: int = 1) -> bool:
    return _positive_int(value) and value >= least and not value & (value - 1)


BIDIRECTIONAL_PARTS = ("own tile", "loop tile", "warps")
NORMALISER_PARTS = ("tokens per chunk", "chunk sums per carry tile", "warps")


def check_launch_setting(setting: object, name: str = "launch setting",
                         parts: Tuple[str, str, str] = BIDIRECTIONAL_PARTS, least: Tuple[int, int] = (16, 16),
                         example: LaunchSetting = (64, 32, 8)) -> LaunchSetting:
    """setting as a tuple of three powers of two (the first two at least `least`, the last the warps), as the
    kernels can run it; ValueError naming the parts where it is not."""
    values = tuple(setting) if isinstance(setting, (tuple, list)) else ()
    if len(values) != 3 or not (_power_of_two(values[0], least[0]) and _power_of_two(values[1], least[1])
                                and _power_of_two(values[2])):
        at_least = " and ".join(f"{part} at least {n}" for part, n in zip(parts, least) if n > 1)
        raise ValueError(f"{name} must be ({', '.join(parts)}): powers of two, {at_least}, e.g. {example}; "
                         f"got {setting!r}")
    return values  # type: ignore[return-value]


_current = Tuning()


def tuning() -> Tuning:
    """The knobs in effect."""
    return _current


@contextmanager
def tuned(**changes: object) -> Iterator[Tuning]:
    """The knobs named (Tuning's fields) set to these values inside the block, then restored. An unknown name or
    a bad value is a ValueError, and changes nothing."""
    global _current
    unknown = sorted(set(changes) - {f.name for f in fields(Tuning)})
    if unknown:
        raise ValueError(f"unknown tuning knob(s) {unknown}; choose from {[f.name for f in fields(Tuning)]}")
    before = _current
    _current = replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before
