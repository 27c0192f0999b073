from __future__ import annotations

import pytest
import xxhash

from tests.unit.checkpoint.synth import TENSORS, Synth, synth
from worker.checkpoint.loadplan import Need, bytes_read, needs_for_rank, plan_reads
from worker.checkpoint.manifest import row_bytes
from worker.errors import CheckpointError


def execute(s: Synth, needs: list[Need], **kw: int) -> dict[tuple[str, int], bytes]:
    """Run a load plan against the in-memory files, checking every block like the reader does."""
    ops = plan_reads(s.manifest, needs, **kw)
    out: dict[tuple[str, int], bytearray] = {}
    for need in needs:
        dtype, shape = s.manifest.tensors[need.name].dtype, s.manifest.tensors[need.name].shape
        out[(need.name, need.start)] = bytearray((need.stop - need.start) * row_bytes(dtype, shape))
    for op in ops:
        data = s.files[op.file][op.offset : op.offset + op.nbytes]
        assert len(data) == op.nbytes
        for c in op.checks:
            assert xxhash.xxh3_128_hexdigest(data[c.offset : c.offset + c.nbytes]) == c.digest
        for c in op.copies:
            out[(c.name, c.need_start)][c.dst : c.dst + c.nbytes] = data[c.src : c.src + c.nbytes]
    return {k: bytes(v) for k, v in out.items()}


@pytest.mark.parametrize("new_world", [1, 2, 3, 4])
def test_reshard_from_two_ranks(new_world: int) -> None:
    s = synth(TENSORS, 2)
    for rank in range(new_world):
        needs = needs_for_rank(s.manifest, rank=rank, world_size=new_world)
        got = execute(s, needs)
        for need in needs:
            rb = s.manifest.tensors[need.name].row_bytes
            assert got[(need.name, need.start)] == s.logical[need.name][need.start * rb : need.stop * rb]


def test_per_rank_tensors_go_to_their_owner_only() -> None:
    s = synth(TENSORS, 2)
    assert "rank1/extra" in {n.name for n in needs_for_rank(s.manifest, rank=1, world_size=3)}
    assert "rank1/extra" not in {n.name for n in needs_for_rank(s.manifest, rank=2, world_size=3)}


def test_a_slice_reads_only_its_blocks_and_verifies_them() -> None:
    s = synth({"big": ("float32", (400, 4), "replicated")}, 1, block_size=64)
    ops = plan_reads(s.manifest, [Need("big", 100, 104)])  # bytes [1600, 1664): exactly block 25
    assert bytes_read(ops) == 64 and len(ops[0].checks) == 1
    ops = plan_reads(s.manifest, [Need("big", 101, 105)])  # straddles blocks 25 and 26
    assert bytes_read(ops) == 128 and len(ops[0].checks) == 2
    assert execute(s, [Need("big", 101, 105)])[("big", 101)] == s.logical["big"][101 * 16 : 105 * 16]


def test_adjacent_reads_merge_up_to_the_cap() -> None:
    s = synth({f"t{i}": ("float32", (4,), "replicated") for i in range(10)}, 1)
    needs = [Need(f"t{i}", 0, 4) for i in range(10)]
    assert len(plan_reads(s.manifest, needs)) == 1
    assert len(plan_reads(s.manifest, needs, max_read=32)) == 5
    got = execute(s, needs, max_read=32)
    assert all(got[(f"t{i}", 0)] == s.logical[f"t{i}"] for i in range(10))
    # a read of at least `small` bytes stays alone (it goes straight into the tensor)
    assert len(plan_reads(s.manifest, needs, small=16)) == 10


def test_unknown_tensor_or_rows_out_of_range() -> None:
    s = synth(TENSORS, 2)
    with pytest.raises(CheckpointError, match="not in the checkpoint"):
        plan_reads(s.manifest, [Need("model.nope", 0, 1)])
    with pytest.raises(CheckpointError, match="outside"):
        plan_reads(s.manifest, [Need("model.a.bias", 0, 8)])


@pytest.mark.parametrize("new_world", [3, 4])
def test_resharding_fsdp_reads_little_beyond_what_a_rank_needs(new_world: int) -> None:
    """A reshard reads whole blocks; at the default block size a rank of the new world reads at
    most 1.2x the bytes it needs of a W=2 FSDP checkpoint of 1024x1024 fp32 tensors."""
    from worker.checkpoint.blocks import DEFAULT_BLOCK_SIZE

    s = synth(
        {"optim.state.w.exp_avg": ("float32", (1024, 1024), "sharded")}, 2, block_size=DEFAULT_BLOCK_SIZE
    )
    for rank in range(new_world):
        needs = needs_for_rank(s.manifest, rank=rank, world_size=new_world)
        needed = sum((n.stop - n.start) * 4096 for n in needs)
        assert bytes_read(plan_reads(s.manifest, needs)) <= 1.2 * needed, rank
    got = execute(s, needs)
    assert got[(needs[0].name, needs[0].start)] == s.logical[needs[0].name][needs[0].start * 4096 :]
