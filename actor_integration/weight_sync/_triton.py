# mypy: ignore-errors
# (Triton's JIT language is not typeable: mypy sees `tl.constexpr` annotations and untyped decorators.)
"""The one Triton kernel behind the device copies: copy and/or checksum a table of byte segments.

Imported only where Triton is (the CUDA build of torch ships it); `kernels.py` is the front end.
Every address is an int32-word offset from one `anchor` tensor, so a single launch reaches any
number of tensors and buffers (trainer tensors, IPC-mapped staging, engine weights) and the
compiler, told the offsets are multiples of 4 words, moves 16-byte vectors. Checksummed modes add
each chunk's (s1, s2) into `sums[group]` with integer atomics: exact, independent of the order the
chunks run in, and no second kernel to reduce per-chunk partials.
"""

import triton
import triton.language as tl

GATHER = 0  # tensors -> bucket: copy, zero the word padding, checksum what was written
VERIFY = 1  # bucket: checksum only
SCATTER = 2  # bucket -> tensors: copy byte-exact (no write past a tensor's end), no checksum
# bucket -> tensors, byte-exact like SCATTER, and the checksum of every word read: the tensor and
# the padding after it up to its 16-byte boundary, so a round whose entries tile their buckets
# is checked against the senders' WSUM64 in the pass that writes it (the two-pass path).
SCATTER_CHECKED = 3
# tensors: checksum only, reading like GATHER (bytes past a tensor's end count as zeros), each word
# weighted by its index in the bucket the tensor came from: the digest of what a round wrote,
# computed where it was written, compared with the sender's WSUM64.
DIGEST = 4
COLUMNS = 4  # table row: src word offset, dst word offset, bytes, group << 32 | word index in the bucket


@triton.jit
def segments_kernel(
    anchor,
    table,
    sums,
    gate,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    GATED: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = table + pid * 4
    src = tl.multiple_of(tl.load(row), 4)
    dst = tl.multiple_of(tl.load(row + 1), 4)
    nbytes = tl.load(row + 2).to(tl.int32)  # a chunk is far below 2 GiB
    if GATED:
        # `gate` is the receiver's verdict on the round, computed on the device just before: 0
        # (a checksum failed) turns every chunk into zero bytes, so nothing is written.
        nbytes = nbytes * tl.load(gate)
    tag = tl.load(row + 3)
    pos = tag.to(tl.int32)  # the low 32 bits: word index in the bucket, wrapping like the checksum
    group = tag >> 32  # which (s1, s2) pair of `sums` this chunk adds to
    copies = MODE == 2 or MODE == 3  # byte-exact copies into tensors
    nvec = (nbytes // 16) * 4 if copies else ((nbytes + 15) // 16) * 4  # words written
    nvec = tl.multiple_of(nvec, 4)
    nread = ((nbytes + 15) // 16) * 4 if MODE == 3 else nvec  # words read (and summed)
    nread = tl.multiple_of(nread, 4)
    src_ptr = anchor + src
    dst_ptr = anchor + dst
    lane = tl.arange(0, BLOCK)
    acc1 = tl.zeros([BLOCK], dtype=tl.int32)
    acc2 = tl.zeros([BLOCK], dtype=tl.int32)
    # A chunk is at most BLOCK * ITERS words; a static trip count with masks (no data-dependent
    # loop bound) compiles to one loop and also runs under TRITON_INTERPRET on CPU tensors.
    for it in range(ITERS):
        offs = lane + it * BLOCK
        mask = offs < nvec
        w = tl.load(src_ptr + offs, mask=offs < nread, other=0)
        if MODE == 0 or MODE == 4:
            # Bytes past the tensor's end (inside its last 16-byte word) are written (or summed) as zeros.
            valid = tl.minimum(tl.maximum(nbytes - offs * 4, 0), 4)
            keep = tl.where(valid == 4, -1, (1 << (valid * 8)) - 1)
            w = w & keep
        if MODE == 0 or copies:
            tl.store(dst_ptr + offs, w, mask=mask)
        if MODE != 2:
            acc1 += w
            acc2 += w * (pos + offs + 1)
    if MODE != 2:
        # Words wrap mod 2**32 as int32; the per-chunk reduction and the atomics are exact in
        # int64 (which wraps mod 2**64, a multiple of the 2**32 the checksum keeps).
        tl.atomic_add(sums + group * 2, tl.sum(acc1.to(tl.int64), axis=0), sem="relaxed")
        tl.atomic_add(sums + group * 2 + 1, tl.sum(acc2.to(tl.int64), axis=0), sem="relaxed")
    if copies:
        tail = nbytes - nvec * 4  # 0 to 15 bytes after the last whole 16-byte word
        a8 = anchor.to(tl.pointer_type(tl.uint8))
        b = tl.arange(0, 16)
        keep8 = b < tail
        x = tl.load(a8 + src * 4 + nvec * 4 + b, mask=keep8)
        tl.store(a8 + dst * 4 + nvec * 4 + b, x, mask=keep8)


def launch(anchor, table, sums, n_chunks, mode, block, iters, num_warps, gate=None):
    segments_kernel[(n_chunks,)](
        anchor,
        table,
        sums,
        gate if gate is not None else anchor,
        MODE=mode,
        BLOCK=block,
        ITERS=iters,
        GATED=gate is not None,
        num_warps=num_warps,
    )
