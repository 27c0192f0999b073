"""The round agreement and the start-up watchdog, on an in-memory store with ranks as threads."""

from __future__ import annotations

import threading

import pytest

from tests.waiting import eventually
from worker.checkpoint.coordinator import MemoryStore
from worker.errors import SpecError
from worker.start.dist import backend_note, detect, init_group
from worker.start.rounds import StartupTimeout, Watchdog, agree_round

BASE = "elastrain/round/job"


def run_ranks(store: MemoryStore, world: int, ranks: list[int], timeout_s: float = 20.0) -> dict[int, object]:
    """Each rank of ``ranks`` agrees in its own thread; its token, or the error it raised."""
    out: dict[int, object] = {}

    def one(rank: int) -> None:
        try:
            out[rank] = agree_round(store, rank=rank, world_size=world, base=BASE, timeout_s=timeout_s)
        except Exception as exc:
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def leave_a_dead_round(store: MemoryStore, world: int) -> str:
    """What a group killed in the middle of its start-up leaves: every rank's hello, replies,
    joined keys, under a token of its own."""
    old = "old-token"
    for r in range(1, world):
        store.set(f"{BASE}/hello/{r}", f"old-nonce-{r}")
        store.set(f"{BASE}/reply/old-nonce-{r}", old)
        store.set(f"{BASE}/{old}/joined/{r}", "1")
    return old


def test_every_rank_gets_the_same_fresh_token() -> None:
    out = run_ranks(MemoryStore(), 4, [0, 1, 2, 3])
    assert all(isinstance(v, str) for v in out.values()), out
    assert len(set(out.values())) == 1


def test_an_earlier_rounds_keys_never_leak_into_the_new_round() -> None:
    store = MemoryStore()
    old = leave_a_dead_round(store, 4)
    out = run_ranks(store, 4, [3, 2, 1, 0])
    tokens = set(out.values())
    assert len(tokens) == 1 and old not in tokens, out


def test_rank_0_first_answers_a_stale_hello_then_the_fresh_one() -> None:
    """Rank 0 starts alone and answers the dead group's hello; the fresh rank arrives later and
    still gets this round's token (and the reply nobody will read is removed)."""
    store = MemoryStore()
    leave_a_dead_round(store, 2)
    store.delete_key(f"{BASE}/reply/old-nonce-1")
    out: dict[int, object] = {}
    leader = threading.Thread(
        target=lambda: out.update({0: agree_round(store, rank=0, world_size=2, base=BASE, timeout_s=20)})
    )
    leader.start()
    eventually("rank 0 answers the stale hello", lambda: store.check([f"{BASE}/reply/old-nonce-1"]), 20.0)
    out.update(run_ranks(store, 2, [1]))
    leader.join()
    assert out[0] == out[1] and out[0] != "old-token", out
    assert not store.check([f"{BASE}/reply/old-nonce-1"])


def test_a_missing_rank_is_named_when_the_time_is_up() -> None:
    out = run_ranks(MemoryStore(), 3, [0, 1], timeout_s=0.3)
    assert isinstance(out[0], StartupTimeout) and "ranks 2 to join" in str(out[0]), out
    assert isinstance(out[1], str), out  # rank 1 was answered; only rank 2 never came
    alone = run_ranks(MemoryStore(), 2, [1], timeout_s=0.3)
    assert isinstance(alone[1], StartupTimeout) and "rank 0 to answer" in str(alone[1]), alone


def test_a_world_of_one_needs_no_store() -> None:
    store = MemoryStore()
    assert agree_round(store, rank=0, world_size=1, base=BASE, timeout_s=0.1)
    assert not store.check([f"{BASE}/hello/0"])


def test_the_watchdog_names_the_wait_that_ran_out() -> None:
    lines: list[str] = []
    released = threading.Event()

    def expire(line: str) -> None:
        lines.append(line)
        released.set()

    with Watchdog(0.1, rank=1, on_expire=expire, grace_s=0.0) as watch:
        watch.stage("the store at 10.0.0.1:29500")
        assert released.wait(30), "the watchdog never fired"
    assert len(lines) == 1
    assert lines[0].startswith("elastrain worker (rank 1): error: waited "), lines
    assert "for the store at 10.0.0.1:29500; start-up gave up after " in lines[0], lines
    assert lines[0].endswith("(ELASTRAIN_COLLECTIVE_TIMEOUT_S=0.1)"), lines


def test_the_watchdog_stays_quiet_when_start_up_ends_in_time() -> None:
    lines: list[str] = []
    with Watchdog(60, rank=0, on_expire=lines.append) as watch:
        watch.stage("nothing")
    assert lines == []  # __exit__ joined the watchdog's thread: it can no longer fire


def test_a_torch_error_is_reported_with_the_stage() -> None:
    with Watchdog(60, rank=0, on_expire=lambda _: None) as watch:
        watch.stage("the gloo process group of 2 ranks to form")
        err = watch.failed(RuntimeError("Connection reset by peer\nlong C++ trace"))
    assert "for the gloo process group of 2 ranks to form: Connection reset by peer" in str(err)
    assert "C++ trace" not in str(err)


def test_detect_reads_the_store_address() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "none"}
    assert detect(env, backend="gloo", gpus=0).store_addr == ""
    info = detect(env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, backend="gloo", gpus=0)
    assert info.under_torchrun and info.store_addr == "127.0.0.1:29500" and info.run_id == "none"
    assert detect({}, backend="gloo", gpus=0).store_addr == ""


def test_a_rank_without_the_store_address_is_told_what_to_set() -> None:
    info = detect({"RANK": "1", "WORLD_SIZE": "2"}, backend="gloo", gpus=0)
    with pytest.raises(SpecError, match="MASTER_ADDR and MASTER_PORT are not both set"):
        init_group(info, timeout_s=1)


def node(local: int, local_world: int) -> dict[str, str]:
    return {"RANK": str(local), "WORLD_SIZE": str(local_world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(local_world)}  # fmt: skip


@pytest.mark.parametrize(
    ("local_world", "gpus", "backend", "device"),
    [
        (1, 0, "gloo", "cpu"),  # no GPU
        (2, 2, "nccl", "cuda:1"),  # a GPU per process: process 1 on GPU 1
        (2, 8, "nccl", "cuda:1"),
        (4, 2, "gloo", "cpu"),  # too few: every process of the node on CPU, not half of them
    ],
)
def test_auto_takes_nccl_only_when_each_process_of_the_node_has_a_gpu(
    local_world: int, gpus: int, backend: str, device: str
) -> None:
    info = detect(node(1, local_world), backend="auto", gpus=gpus)
    assert (info.backend, info.device) == (backend, device)
    note = backend_note(node(1, local_world), info, backend="auto", gpus=gpus)
    if backend == "gloo" and gpus:
        assert note is not None and f"runs {local_world} processes and sees {gpus} GPU(s)" in note
        assert f"nproc_per_node to at most {gpus}" in note
    else:
        assert note is None


def test_nccl_by_name_without_a_gpu_for_the_process_names_the_field_and_the_fix() -> None:
    with pytest.raises(SpecError, match=r"field 'ddp\.backend': nccl needs a GPU and none is visible"):
        detect(node(0, 1), backend="nccl", gpus=0)
    with pytest.raises(
        SpecError, match=r"process 2 of this node's 3 sees 2 GPU\(s\): set nproc_per_node to at most 2"
    ):
        detect(node(2, 3), backend="nccl", gpus=2)
    assert detect(node(1, 3), backend="nccl", gpus=2).device == "cuda:1"  # this one has its GPU
    # gloo asked for by name: nothing to explain
    assert (
        backend_note(node(0, 3), detect(node(0, 3), backend="gloo", gpus=2), backend="gloo", gpus=2) is None
    )
