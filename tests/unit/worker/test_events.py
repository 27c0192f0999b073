"""The lines a person reads on stderr: a resume (from where, at which world size) and a rank whose
group broke under it (who was lost, and what happens next), from plain values."""

from __future__ import annotations

from worker.report.events import lost_peer_line, resumed_line, torchrun_restarts

GLOO = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:53996: Connection reset by peer. This is typically caused by a remote worker hanging "
    "or bugs in the application. Check the logs of the remote worker before reporting an error."
)


def test_a_resume_names_the_checkpoint_the_step_and_both_world_sizes() -> None:
    same = resumed_line(
        step=8, checkpoint="/ck/step-00000008", samples=128, world_size=2, saved_at=2, note="A=1"
    )
    assert same == "resumed from step 8 (/ck/step-00000008, 128 samples seen) at world size 2: A=1"
    other = resumed_line(
        step=8, checkpoint="/ck/step-00000008", samples=128, world_size=3, saved_at=2, note="n"
    )
    assert "at world size 3 (saved at 2): n" in other


def test_a_lost_peer_is_one_line_with_who_when_and_what_happens_next() -> None:
    line = lost_peer_line(
        rank=0, world_size=2, step=5, error=GLOO, restarts=(0, 3), checkpoints=True,
        traceback_at="/ck/worker-errors.log",
    )  # fmt: skip
    assert line == (
        "elastrain worker (rank 0): lost rank 1 after step 5 (Read error [127.0.0.1]:53996: Connection "
        "reset by peer); torchrun restarts the group (restart 1 of 3), which resumes from the newest "
        "published checkpoint; traceback in /ck/worker-errors.log"
    )


def test_the_next_step_depends_on_the_restarts_left_and_the_checkpoints() -> None:
    def said(restarts: tuple[int, int] | None, checkpoints: bool = True) -> str:
        return lost_peer_line(
            rank=2, world_size=4, step=None, error=GLOO, restarts=restarts, checkpoints=checkpoints,
            traceback_at=None,
        )  # fmt: skip

    assert said((3, 3)).endswith(
        "lost a peer of its group of 4 before its first step (Read error [127.0.0.1]:53996: Connection reset "
        "by peer); no torchrun restart is left (--max-restarts=3): the run stops"
    )
    assert said((1, 3), checkpoints=False).endswith("(restart 2 of 3), which starts over (no checkpoint.dir)")
    assert said(None).endswith("; the run stops")


def test_torchruns_restarts_come_from_its_environment() -> None:
    assert torchrun_restarts({"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"}) == (1, 3)
    assert torchrun_restarts({"TORCHELASTIC_RESTART_COUNT": "1"}) is None
    assert torchrun_restarts({}) is None
