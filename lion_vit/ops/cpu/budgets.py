"""The CPU budgets of the portable forms: bytes per group of (batch, head) rows and rows per block of
the selective mask, sized for a last-level cache. Tuning hooks: tests shrink them to run the grouped
paths at small sizes. The timings behind each number: docs/benchmarks.md ("CPU tuning constants")."""

# Without autograd, the chunk form (and each scan of a multi-scan one) runs a group of rows at a time,
# each group about this many bytes of [L, Dv+1] values, so that its temporaries (scan-ordered inputs,
# values with the ones column, chunk scores, per-chunk states, updates) are a group's size, not the
# whole batch's: at 1248 px, batch 1, they would otherwise lift the model's peak memory above that of
# its MLP.
INFERENCE_GROUP_BYTES = 2 << 20

# In training, the masked product runs a group of slabs of about this many bytes of L x L weights at a
# time, so that its elementwise passes between the matmuls (the mask product and row sums; in the
# backward the normaliser's gradient, the decays' gradient and the mask product) read the group from
# the last-level cache instead of memory (a few groups fit one).
TRAIN_GROUP_BYTES = 4 << 20

# The selective mask's L x L passes walk slabs in groups of about this many bytes (a few per group fit a
# 16 MiB last-level cache), so that its backward's product and four reductions read each group from
# cache instead of memory after the first pass.
MASK_GROUP_BYTES = 4 << 20

# A selective mask is built a block of about this many rows at a time where its scan allows (token
# order, a row snake; see masks.row_blocks), so that each block's passes stay in cache ...
MASK_BLOCK = 32

# ... when it has at least this many entries: on smaller masks (batch-1 inference) the blocks' fixed
# cost per op outweighs what they save.
MASK_BLOCK_MIN_ENTRIES = 1 << 20
