"""The device copy path on a machine without a GPU: the WSUM64 checksum, the torch path of the
kernels, the Triton kernel itself under TRITON_INTERPRET (where Triton is installed), packed
manifests and the layout cache. The GPU tests run the compiled kernel against the same checks."""

import importlib.util
import itertools
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actor_integration.weight_sync import LayoutCache, iter_buckets, kernels
from actor_integration.weight_sync import buckets as buckets_module
from actor_integration.weight_sync.buckets import (
    ALIGN,
    SUM32,
    WSUM64,
    BucketManifest,
    TensorEntry,
    checksum,
    pack_into,
    padded,
    unpack,
)

REPO = Path(__file__).resolve().parents[3]


def words(*values):
    return torch.tensor(values, dtype=torch.int32).view(torch.uint8)


class TestWsum64:
    def test_it_sees_swapped_words_which_the_plain_sum_misses(self):
        region = words(*range(1, 17))
        before = checksum(region, 64, WSUM64)
        swapped = words(2, 1, *range(3, 17))
        assert checksum(swapped, 64, SUM32) == checksum(region, 64, SUM32)  # the plain sum misses it
        assert checksum(swapped, 64, WSUM64) != before

    def test_a_short_host_region_reads_as_zero_padded(self):
        region = torch.arange(1, 22, dtype=torch.uint8)  # 21 bytes: padded to 32
        padded_copy = torch.zeros(32, dtype=torch.uint8)
        padded_copy[:21] = region
        assert checksum(region, 21, WSUM64) == checksum(padded_copy, 21, WSUM64)

    def test_the_pair_wraps_mod_2_32(self):
        region = words(-1, -1, 2**31 - 1, 7)
        value = checksum(region, 16, WSUM64)
        s1 = (-1 - 1 + 2**31 - 1 + 7) % 2**32
        s2 = (-1 * 1 - 1 * 2 + (2**31 - 1) * 3 + 7 * 4) % 2**32
        assert value == (s2 << 32) | s1

    def test_the_sums_of_any_split_of_a_bucket_add_up_to_its_checksum(self):
        """What a receiver wrote is checked piece by piece, wherever each piece went: the pieces'
        sums at their offsets (any byte boundary) add up to the whole bucket's WSUM64."""
        g = torch.Generator().manual_seed(3)
        region = torch.randint(0, 256, (1001,), generator=g, dtype=torch.uint8)
        cuts = [0, 1, 2, 7, 16, 17, 333, 334, 998, 1001]
        total = sum(buckets_module.wsum64_segment(region[a:b], a) for a, b in itertools.pairwise(cuts))
        assert buckets_module.wsum64_value(total) == checksum(region, 1001, WSUM64)
        moved = region[333:998].clone()  # a piece held elsewhere, as a parameter holds it
        assert torch.equal(
            buckets_module.wsum64_segment(moved, 333), buckets_module.wsum64_segment(region[333:998], 333)
        )
        moved[100] ^= 1
        assert not torch.equal(
            buckets_module.wsum64_segment(moved, 333), buckets_module.wsum64_segment(region[333:998], 333)
        )


class TestTorchPath:
    def test_awkward_tensors_pack_verify_and_unpack_like_torch(self):
        """Every dtype, odd sizes, a strided and a misaligned tensor; targets with sentinels around."""
        assert kernels.self_check("cpu", large=True) == []

    def test_the_packer_reads_every_checksum_of_a_round_at_once(self):
        named = {f"w{i}": torch.randn(100 + i) for i in range(5)}
        packer = kernels.DevicePacker(torch.device("cpu"))
        buckets = list(iter_buckets(named, 1024, align=ALIGN))
        regions = [torch.empty(padded(b.nbytes, ALIGN), dtype=torch.uint8) for b in buckets]
        for k, (b, r) in enumerate(zip(buckets, regions, strict=True)):
            packer.pack(k, r, b)
        values = packer.seal()
        assert values == [checksum(r, b.nbytes, WSUM64) for b, r in zip(buckets, regions, strict=True)]
        assert values == kernels.verify(regions, [b.nbytes for b in buckets], torch.device("cpu"))
        assert packer.seal() == []


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (CUDA builds ship it)"
)
class TestTritonKernelInterpreted:
    def test_the_kernel_agrees_with_torch_bit_for_bit(self):
        """The Triton kernel itself, run by Triton's interpreter on CPU tensors (in a fresh process:
        the interpreter is chosen when the kernel module is imported)."""
        code = (
            "from actor_integration.weight_sync import kernels\n"
            "kernels.INTERPRET_ON_CPU = True\n"
            "assert kernels.fused(__import__('torch').device('cpu'))\n"
            "problems = kernels.self_check('cpu', large=False)\n"
            "assert problems == [], problems\n"
        )
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (CUDA builds ship it)"
)
class TestTritonKernelCompiled:
    def test_every_mode_compiles_for_sm90_with_16_byte_vector_loads_and_stores(self):
        """Compiled for an H100/H200 target without a GPU (pointers 16-byte aligned, as Triton
        specialises them at launch): the copy modes move whole 16-byte vectors, the checked
        copy like the plain one, the checksummed modes add with atomics, and the digest of what
        was written reads and adds without storing anything."""
        code = (
            "import re, triton\n"
            "from triton.backends.compiler import GPUTarget\n"
            "from triton.compiler import ASTSource\n"
            "from actor_integration.weight_sync import _triton as k\n"
            "signature = {'anchor': '*i32', 'table': '*i64', 'sums': '*i64', 'gate': '*i32', 'MODE': 'constexpr',"
            " 'BLOCK': 'constexpr', 'ITERS': 'constexpr', 'GATED': 'constexpr'}\n"
            "attrs = {(i,): [['tt.divisibility', 16]] for i in range(4)}\n"
            "for mode in range(5):\n"
            "    constexprs = {'MODE': mode, 'BLOCK': 1024, 'ITERS': 16, 'GATED': False}\n"
            "    source = ASTSource(fn=k.segments_kernel, signature=signature, constexprs=constexprs, attrs=attrs)\n"
            "    ptx = triton.compile(source, target=GPUTarget('cuda', 90, 32), options={'num_warps': 4}).asm['ptx']\n"
            # Atomic adds whose result is unused: red.global (older Triton) or atom.global (Triton 3.8).
            "    ops = re.findall(r'\\b((?:ld|st)\\.global\\.v4|(?:red|atom)\\.global)', ptx)\n"
            "    atomics = ops.count('red.global') + ops.count('atom.global')\n"
            "    print(mode, ops.count('ld.global.v4'), ops.count('st.global.v4'), atomics)\n"
        )
        env = dict(
            os.environ, TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=os.pathsep.join([str(REPO), *sys.path])
        )
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stderr[-3000:]
        counts = {
            int(line.split()[0]): [int(v) for v in line.split()[1:]] for line in run.stdout.splitlines()
        }
        gather, verify, scatter, checked, digest = (counts[m] for m in range(5))
        assert all(c[0] > 0 for c in counts.values())  # 16-byte loads in every mode
        assert gather[1] > 0 and scatter[1] > 0 and checked[1] == scatter[1] and verify[1] == digest[1] == 0
        assert gather[2] == verify[2] == checked[2] == digest[2] > 0 and scatter[2] == 0


class TestTilesBucket:
    def test_an_aligned_layout_tiles_its_buckets(self):
        named = {
            "a": torch.zeros(3, dtype=torch.int8),
            "b": torch.zeros(0),
            "c": torch.zeros(5, dtype=torch.bfloat16),
        }
        for bucket in iter_buckets(named, 1 << 20, align=ALIGN):
            assert buckets_module.tiles_bucket(bucket.entries, bucket.nbytes)

    def test_a_safetensors_layout_or_a_gap_does_not(self):
        named = {"a": torch.zeros(3, dtype=torch.int8), "c": torch.zeros(5, dtype=torch.float32)}
        (packed,) = iter_buckets(named, 1 << 20, align=1)  # ordered by element size, no padding
        assert not buckets_module.tiles_bucket(packed.entries, packed.nbytes)
        gap = [TensorEntry("a", (4,), "float32", 0, 16), TensorEntry("b", (4,), "float32", 32, 16)]
        assert not buckets_module.tiles_bucket(gap, 48)
        assert buckets_module.tiles_bucket(gap[:1], 16) and not buckets_module.tiles_bucket(gap[:1], 20)


class TestPackedEntries:
    def layout(self, count=1000):
        named = {
            f"model.layers.{i}.mlp.weight": torch.zeros(3, i % 7 + 1, dtype=torch.bfloat16)
            for i in range(count)
        }
        (bucket,) = iter_buckets(named, 1 << 30, align=ALIGN)
        return named, bucket

    def test_entries_round_trip_through_pickle_as_two_flat_fields(self):
        """A thousand entries pickle as one string and one byte array, not a thousand objects."""
        named, bucket = self.layout()
        data = pickle.dumps(bucket.manifest(5, WSUM64))
        manifest = pickle.loads(data)
        assert manifest.entries == bucket.entries and manifest.entries.key == bucket.entries.key
        assert manifest.names == tuple(named)
        assert b"TensorEntry" not in data and b"TensorEntry" in pickle.dumps(tuple(bucket.entries))
        assert manifest.entries == BucketManifest(0, bucket.nbytes, tuple(bucket.entries), 5, WSUM64).entries
        first = manifest.entries[0]
        assert first == TensorEntry("model.layers.0.mlp.weight", (3, 1), "bfloat16", 0, 6)
        assert [e.offset % ALIGN for e in manifest.entries] == [0] * len(named)

    def test_views_unpack_from_packed_entries(self):
        named = {"a": torch.arange(5, dtype=torch.int16), "b": torch.ones(2, 2)}
        (bucket,) = iter_buckets(named, 1 << 20, align=ALIGN)
        region = torch.zeros(padded(bucket.nbytes, ALIGN), dtype=torch.uint8)
        pack_into(region, bucket)
        views = dict(unpack(region, bucket.manifest(0, WSUM64)))
        assert torch.equal(views["a"], named["a"]) and torch.equal(views["b"], named["b"])


class TestLayoutCache:
    def named(self, seed=0, shape=(8, 8)):
        g = torch.Generator().manual_seed(seed)
        return {f"w{i}": torch.randn(*shape, generator=g) for i in range(10)}

    def test_a_repeated_mapping_reuses_every_layout(self):
        cache = LayoutCache()
        first = list(iter_buckets(self.named(1), 600, align=ALIGN, cache=cache))
        second = list(iter_buckets(self.named(2), 600, align=ALIGN, cache=cache))
        assert len(first) == len(second) > 2
        assert all(a.entries is b.entries for a, b in zip(first, second, strict=True))
        assert cache.hits == len(second)

    def test_a_repeated_generator_reuses_them_too_and_stays_lazy(self):
        cache = LayoutCache()
        list(iter_buckets(self.named(1).items(), 600, align=ALIGN, cache=cache))
        pulled = []

        def produce():
            for name, tensor in self.named(2).items():
                pulled.append(name)
                yield name, tensor

        buckets = iter_buckets(produce(), 600, align=ALIGN, cache=cache)
        first = next(buckets)
        assert len(pulled) == len(first.tensors)  # the bucket closed without pulling the next tensor
        rest = list(buckets)
        assert cache.hits == 1 + len(rest)

    @pytest.mark.parametrize("how", ["mapping", "generator"])
    def test_a_changed_update_is_laid_out_again_and_stays_bit_exact(self, how):
        cache = LayoutCache()
        list(iter_buckets(self.named(1), 600, align=ALIGN, cache=cache))
        changed = self.named(3)
        changed["w4"] = torch.randn(3, 5)  # a shape changes in the middle
        changed["w9b"] = torch.randn(2)  # and a tensor is added at the end
        source = changed if how == "mapping" else changed.items()
        out = {}
        for bucket in iter_buckets(source, 600, align=ALIGN, cache=cache):
            region = torch.zeros(padded(bucket.nbytes, ALIGN), dtype=torch.uint8)
            pack_into(region, bucket)
            out.update((n, v.clone()) for n, v in unpack(region, bucket.manifest(0, WSUM64)))
        assert list(out) == list(changed)
        assert all(torch.equal(out[n], t) for n, t in changed.items())

    def test_a_duplicate_name_after_the_cached_part_is_still_refused(self):
        cache = LayoutCache()
        named = self.named(1)
        list(iter_buckets(named.items(), 600, align=ALIGN, cache=cache))
        repeated = [*named.items(), ("w0", torch.zeros(1))]
        with pytest.raises(ValueError, match="appears twice"):
            list(iter_buckets(repeated, 600, align=ALIGN, cache=cache))


class TestMetadataGuard:
    """The C++ metadata guard lets a repeated layout skip the per-tensor shape and stride reads;
    any change in dtype, shape or strides must still reach the exact checks."""

    def named(self):
        base = torch.arange(64, dtype=torch.float32).view(8, 8)
        return {"square": base, **{f"w{i}": torch.randn(4, 4) for i in range(6)}}

    def tokens(self, named, cache):
        return [b.token for b in iter_buckets(named, 200, align=ALIGN, cache=cache)]

    def test_an_unchanged_update_carries_the_same_tokens(self):
        if buckets_module._TensorGuards is None:
            pytest.skip("this torch has no TensorGuards")
        cache, named = LayoutCache(), self.named()
        first = self.tokens(named, cache)
        assert all(t is not None for t in first) and len(first) > 2
        assert [a is b for a, b in zip(first, self.tokens(dict(named), cache), strict=True)] == [True] * len(
            first
        )

    @pytest.mark.parametrize(
        "change",
        ["transposed in place", "dtype", "requires_grad"],
    )
    def test_a_changed_tensor_gets_a_new_token_and_stays_bit_exact(self, change):
        cache, named = LayoutCache(), self.named()
        first = self.tokens(named, cache)
        changed = dict(named)
        name = "square" if change == "transposed in place" else "w0"
        if change == "transposed in place":
            changed[name] = named[name].t()  # same address, shape and dtype; other strides
        elif change == "dtype":
            changed[name] = named[name].to(torch.float64)
        else:
            changed[name] = named[name].clone().requires_grad_(True)
        out = {}
        buckets = list(iter_buckets(changed, 200, align=ALIGN, cache=cache))
        k = next(i for i, b in enumerate(buckets) if any(t is changed[name] for t in b.tensors))
        assert buckets[k].token is None or buckets[k].token is not first[k]
        for bucket in buckets:
            region = torch.zeros(padded(bucket.nbytes, ALIGN), dtype=torch.uint8)
            pack_into(region, bucket)
            out.update((n, v.clone()) for n, v in unpack(region, bucket.manifest(0, WSUM64)))
        assert all(torch.equal(out[n], t.detach()) for n, t in changed.items())

    def test_a_guard_that_does_not_tell_strides_apart_is_not_used(self):
        class Lenient:  # a guard of another torch that ignores strides
            def __init__(self, *tensors, **dims):
                self.shapes = [t.shape for t in tensors]

            def check(self, *tensors):
                return [t.shape for t in tensors] == self.shapes

        assert buckets_module._tensor_guards_class(Lenient) is None
        if buckets_module._TensorGuards is not None:
            assert buckets_module._tensor_guards_class(buckets_module._TensorGuards) is not None

    def test_without_tensor_guards_the_exact_checks_alone_run(self, monkeypatch):
        monkeypatch.setattr(buckets_module, "_TensorGuards", None)
        cache, named = LayoutCache(), self.named()
        assert self.tokens(named, cache) == [None] * len(self.tokens(named, cache))
        assert cache.hits > 0


class TestDigestTables:
    """The read-back's chunk rows, with the kernel launch stubbed (the kernel itself is tested under
    the interpreter and on the GPU): built once per set of written tensors, reused after."""

    def test_the_same_written_tensors_reuse_their_rows(self, monkeypatch):
        monkeypatch.setattr(
            kernels, "_module", type("Launcher", (), {"launch": staticmethod(lambda *a: None)})
        )
        monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", True)
        builds = []
        real = kernels.Table.build.__func__

        def counting(cls, *args, **kwargs):
            builds.append(1)
            return real(cls, *args, **kwargs)

        monkeypatch.setattr(kernels.Table, "build", classmethod(counting))
        params = [torch.zeros(64), torch.zeros(32)]
        segments = [(params[0], 0, 0), (params[1], 0, 256)]
        for _ in range(3):
            kernels.written_sums(segments, 1, "cpu")
        assert len(builds) == 1
        kernels.written_sums([(params[1], 0, 0)], 1, "cpu")  # other places in the bucket: other rows
        assert len(builds) == 2


class TestPackerPlans:
    """The device packer's plan cache, with the kernel launch stubbed (the copy kernel itself is
    tested under the interpreter and on the GPU): which tensors it sends to the kernel."""

    @pytest.fixture
    def packer(self, monkeypatch):
        monkeypatch.setattr(
            kernels, "_module", type("Launcher", (), {"launch": staticmethod(lambda *a: None)})
        )
        monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", True)
        return kernels.DevicePacker(torch.device("cpu"))

    def pack(self, packer, named, cache):
        for bucket in iter_buckets(named, 1 << 20, align=ALIGN, cache=cache):
            region = torch.zeros(padded(bucket.nbytes, ALIGN) + 16, dtype=torch.uint8)
            packer.pack(("p", bucket.index), region, bucket, sums=torch.zeros(2, dtype=torch.int64))
        return packer._plans[("p", 0)]

    def test_a_tensor_transposed_in_place_leaves_the_kernel_for_torch(self, packer):
        base = torch.arange(64, dtype=torch.float32).view(8, 8)
        named = {"square": base, "other": torch.ones(16)}
        cache = LayoutCache()
        plan = self.pack(packer, named, cache)
        assert plan.slow == [] and packer.plans_built == 1
        # The region of the cached plan is a new tensor each call here: keep it to test reuse.
        region = torch.zeros(1024, dtype=torch.uint8)
        (bucket,) = iter_buckets(named, 1 << 20, align=ALIGN, cache=cache)
        packer.pack("kept", region, bucket, sums=torch.zeros(2, dtype=torch.int64))
        (again,) = iter_buckets(dict(named), 1 << 20, align=ALIGN, cache=cache)
        packer.pack("kept", region, again, sums=torch.zeros(2, dtype=torch.int64))
        assert packer.plans_built == 2  # reused: same addresses, and the token vouches for the strides
        (moved,) = iter_buckets(
            {"square": base.t(), "other": named["other"]}, 1 << 20, align=ALIGN, cache=cache
        )
        assert moved.tensors[0].data_ptr() == base.data_ptr()
        packer.pack("kept", region, moved, sums=torch.zeros(2, dtype=torch.int64))
        assert packer.plans_built == 3
        assert packer._plans["kept"].slow == [0]  # not contiguous: copied by torch, not the kernel
        assert torch.equal(region[:256].view(torch.float32).view(8, 8), base.t())

    def test_two_alternating_weight_sets_each_keep_their_plan_and_a_third_rebuilds(self, packer):
        """A sender alternating between two sets of buffers (the slime GPU test's two weight sets;
        converted tensors the caching allocator places one of two ways) builds each set's tables
        once: on the H200 the rebuild on every update was the suspect of a 93-130 ms export."""
        sets = [{"a": torch.full((64,), float(k)), "b": torch.full((40,), -float(k))} for k in range(3)]
        region, cache = torch.zeros(1024, dtype=torch.uint8), LayoutCache()

        def pack(named):
            (bucket,) = iter_buckets(named.items(), 1 << 20, align=ALIGN, cache=cache)
            packer.pack("p0", region, bucket, sums=torch.zeros(2, dtype=torch.int64))
            return packer._plans["p0"]

        plans = [pack(sets[k % 2]) for k in range(6)]
        assert packer.plans_built == 2
        assert plans[0] is plans[2] is plans[4] and plans[1] is plans[3] is plans[5]
        assert plans[0] is not plans[1]
        third = pack(sets[2])  # a third set: built, and it pushes out the set used longest ago
        assert packer.plans_built == 3 and third.pointers == [t.data_ptr() for t in sets[2].values()]
        assert pack(sets[1]) is plans[1] and packer.plans_built == 3
        assert pack(sets[0]) is not plans[0] and packer.plans_built == 4
        packer.clear()
        pack(sets[1])
        assert packer.plans_built == 5  # clear() dropped both

    def test_an_arena_of_more_buckets_than_the_shared_cache_builds_each_checksum_table_once(
        self, packer, monkeypatch
    ):
        """An arena's regions are checksummed every update; their chunk tables are kept per
        position. In the shared cache (16 entries) an arena of 17 buckets rebuilt all of them
        on every update: 12.2 ms of sender host time on the H200 for the Qwen3-4B layout."""
        built = []
        build = kernels.Table.build
        monkeypatch.setattr(kernels.Table, "build", lambda *a, **k: built.append(1) or build(*a, **k))
        regions = [torch.zeros(4096 + 16, dtype=torch.uint8) for _ in range(kernels._VERIFY_TABLES_KEPT + 4)]
        for _update in range(3):
            for k, region in enumerate(regions):
                packer.checksum(region, 4096, sums=torch.zeros(2, dtype=torch.int64), key=f"a{k}")
        assert len(built) == len(regions)
        moved = torch.zeros(4096 + 16, dtype=torch.uint8)  # a new arena: its tables are built anew
        packer.checksum(moved, 4096, sums=torch.zeros(2, dtype=torch.int64), key="a0")
        assert len(built) == len(regions) + 1
