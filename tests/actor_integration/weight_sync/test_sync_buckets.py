"""Buckets: layout, packing round trips, laziness, checksums, refusals."""

import pytest
import torch

from actor_integration.weight_sync import CRC32, SUM32, WSUM64, iter_buckets, pack_into, unpack
from actor_integration.weight_sync.buckets import checksum, padded


def mixed_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(5, generator=g),
        "c.i8": torch.randint(-100, 100, (9,), generator=g, dtype=torch.int8),
        "d.bool": torch.rand(3, generator=g) > 0.5,
        "e.scalar": torch.tensor(3.25, dtype=torch.float64),
        "f.empty": torch.empty(0, 4),
        "g.strided": torch.randn(6, 4, generator=g).t(),  # non-contiguous source
        "h.i64": torch.arange(3, dtype=torch.int64),
    }


def roundtrip(named, bucket_bytes):
    out = {}
    for bucket in iter_buckets(named, bucket_bytes):
        region = torch.zeros(padded(bucket.nbytes) + 3, dtype=torch.uint8)
        pack_into(region, bucket)
        manifest = bucket.manifest(checksum(region, bucket.nbytes, CRC32), CRC32)
        for name, view in unpack(region, manifest):
            out[name] = view.clone()
    return out


class TestLayout:
    def test_offsets_are_aligned_and_leave_no_holes(self):
        (bucket,) = iter_buckets(mixed_tensors(), 1 << 20)
        end = 0
        for entry, tensor in zip(bucket.entries, bucket.tensors, strict=True):
            assert entry.offset == end
            assert entry.offset % tensor.element_size() == 0
            end += entry.nbytes
        assert end == bucket.nbytes
        sizes = [t.element_size() for t in bucket.tensors]
        assert sizes == sorted(sizes, reverse=True)

    def test_buckets_respect_the_size_and_an_oversized_tensor_travels_alone(self):
        named = [("small0", torch.zeros(10)), ("big", torch.zeros(100)), ("small1", torch.zeros(10))]
        buckets = list(iter_buckets(named, 200))
        assert [b.entries[0].name for b in buckets] == ["small0", "big", "small1"]
        assert [b.nbytes for b in buckets] == [40, 400, 40]
        assert [b.index for b in buckets] == [0, 1, 2]

    def test_tensors_are_grouped_greedily_in_order(self):
        named = [(f"t{i}", torch.zeros(25)) for i in range(5)]  # 100 bytes each
        assert [len(b.entries) for b in iter_buckets(named, 250)] == [2, 2, 1]


class TestPacking:
    @pytest.mark.parametrize("bucket_bytes", [1, 64, 1 << 20])
    def test_round_trip_is_bit_exact_for_every_dtype(self, bucket_bytes):
        named = mixed_tensors()
        out = roundtrip(named, bucket_bytes)
        assert set(out) == set(named)
        for name, tensor in named.items():
            assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
            assert torch.equal(
                out[name].reshape(-1).view(torch.uint8), tensor.contiguous().reshape(-1).view(torch.uint8)
            )

    def test_a_generator_is_consumed_one_bucket_ahead(self):
        pulled = []

        def produce():
            for i in range(6):
                pulled.append(i)
                yield f"t{i}", torch.zeros(25)

        buckets = iter_buckets(produce(), 100)
        first = next(buckets)
        assert [e.name for e in first.entries] == ["t0"]
        assert pulled == [0, 1]  # t1 closed bucket 0; nothing further was materialised


class TestChecksums:
    def test_crc32_sees_a_flipped_byte(self):
        region = torch.arange(64, dtype=torch.uint8)
        before = checksum(region, 64, CRC32)
        region[17] ^= 1
        assert checksum(region, 64, CRC32) != before

    @pytest.mark.parametrize("kind", [SUM32, WSUM64])
    def test_word_sums_see_a_flipped_bit_and_a_zeroed_tail(self, kind):
        region = torch.arange(1, 65, dtype=torch.uint8)
        before = checksum(region, 64, kind)
        flipped = region.clone()
        flipped[3] ^= 4
        assert checksum(flipped, 64, kind) != before
        truncated = region.clone()
        truncated[48:] = 0
        assert checksum(truncated, 64, kind) != before

    def test_unknown_kind_is_refused(self):
        with pytest.raises(ValueError, match="unknown checksum kind"):
            checksum(torch.zeros(4, dtype=torch.uint8), 4, "md5")


class TestRefusals:
    @pytest.mark.parametrize(
        ("named", "error", "message"),
        [
            ([("a", torch.zeros(1)), ("a", torch.zeros(1))], ValueError, "appears twice"),
            ([("a", [1.0])], TypeError, "not a torch.Tensor"),
            ([("", torch.zeros(1))], ValueError, "non-empty strings"),
            ([("a", torch.zeros(1, dtype=torch.complex64))], ValueError, "do not carry"),
            ([("a", torch.zeros(1, device="meta"))], ValueError, "meta device"),
            ([torch.zeros(1)], TypeError, "pairs"),
        ],
    )
    def test_bad_input_is_refused_with_the_reason(self, named, error, message):
        with pytest.raises(error, match=message):
            list(iter_buckets(named, 1 << 20))

    def test_a_tensor_moved_to_meta_under_a_cached_layout_is_refused_where_it_is_copied(self):
        """The cached layout compares dtypes and shapes only; the copy names the meta tensor."""
        from actor_integration.weight_sync import kernels
        from actor_integration.weight_sync.buckets import ALIGN, LayoutCache

        cache = LayoutCache()
        named = {"a": torch.zeros(4), "b": torch.ones(3)}
        list(iter_buckets(named, 1 << 20, align=ALIGN, cache=cache))
        moved = {"a": torch.zeros(4), "b": torch.empty(3, device="meta")}
        (bucket,) = iter_buckets(moved, 1 << 20, align=ALIGN, cache=cache)
        assert cache.hits == 1
        region = torch.zeros(padded(bucket.nbytes, ALIGN), dtype=torch.uint8)
        with pytest.raises(ValueError, match="'b' is on the meta device"):
            pack_into(region, bucket)
        with pytest.raises(ValueError, match="'b' is on the meta device"):
            kernels.DevicePacker(torch.device("cpu")).pack("k", region, bucket)

    @pytest.mark.parametrize("bucket_bytes", [0, -1, 1.5, True])
    def test_bucket_bytes_must_be_a_positive_int(self, bucket_bytes):
        with pytest.raises(ValueError, match="bucket_bytes"):
            list(iter_buckets({"a": torch.zeros(1)}, bucket_bytes))
