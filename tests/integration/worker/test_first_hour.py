"""A new user's first hour: a Hugging Face GPT-NeoX from the team's own module (built from a
config, no download) on a nanoGPT-style token file, under torchrun on CPU/gloo.

What they read must be enough: a rank lost mid-run is one line on the survivor (who, and what
happens next; the traceback goes to the run directory), the restarted group says on stderr
that it resumed, from which checkpoint and step and at which world size; and each usual mistake
(the token file's width, the factory's module or function) is one line naming the field and the
fix, exit code 2, nothing trained.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.launch import REPO, run_worker, write_spec

pytestmark = pytest.mark.integration
MODELS = "tests.integration.worker.user_models"
SEQ = 16


def token_file(path: Path, dtype: str = "uint16") -> str:
    """nanoGPT's prepare.py: ``np.array(ids, dtype).tofile(path)``; ids of a 97-token vocabulary."""
    np.random.default_rng(0).integers(0, 97, 96 * SEQ + 1).astype(dtype).tofile(path)
    return str(path)


def spec(tmp: Path, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "neox",
        "model": {"factory": f"{MODELS}:gpt_neox"},
        "data": {
            "name": "token-file",
            "path": token_file(tmp / "train.bin"),
            "dtype": "uint16",
            "seq_len": SEQ,
        },
        "micro_batch_size": 4,
        "max_steps": 12,
        "seed": 3,
        "log_every_steps": 4,
        "checkpoint": {"dir": str(tmp / "ck"), "interval_steps": 4},
    }
    return base | over


def test_a_lost_rank_is_one_line_and_the_restarted_group_says_where_it_resumed(tmp_path: Path) -> None:
    env = {"ELASTRAIN_FAILPOINTS": "after_grad_sync=kill@1#7^0"}  # rank 1 at step 7, first attempt only
    run = run_worker(write_spec(tmp_path, spec(tmp_path)), nproc=2, max_restarts=1, env=env)
    assert run.code == 0, run.stderr[-4000:]
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    ck = tmp_path / "ck"
    lost = [line for line in run.stderr.splitlines() if line.startswith("elastrain worker (rank 0): lost")]
    assert len(lost) == 1, run.stderr[-4000:]
    assert re.fullmatch(
        r"elastrain worker \(rank 0\): lost rank 1 after step \d+ \(.+\); torchrun restarts the group "
        r"\(restart 1 of 1\), which resumes from the newest published checkpoint; traceback in "
        + re.escape(f"{ck}/worker-errors.log"),
        lost[0],
    ), lost[0]
    assert "Traceback (most recent call last)" in (ck / "worker-errors.log").read_text()
    resumed = run.last("resumed")
    assert resumed["step"] == 4
    said = f"[elastrain neox] resumed from step 4 ({ck}/step-00000004, 32 samples seen) at world size 2: "
    assert said in run.stderr, run.stderr[-4000:]
    assert run.last("finished")["step"] == 12


@pytest.mark.parametrize(
    ("mistake", "says"),
    [
        (
            {"written": "int64"},
            r"field 'data.dtype': '.*train.bin' looks written as int64, not uint16 \(.*\); token files hold "
            r"uint16 or uint32 ids: write it again with np.array\(ids, dtype=np.uint16\).tofile\(path\) and "
            r"give data.dtype 'uint16'",
        ),
        (
            {"dtype": "uint32"},
            r"field 'data.dtype': '.*train.bin' .*uint32.*; give data.dtype 'uint16'.*",
        ),
        (
            {"factory": "neox_modles:gpt_neox"},
            r"field 'model.factory': no module 'neox_modles' \(for 'neox_modles:gpt_neox'\) in the working "
            f"directory {re.escape(str(REPO))}, .*nor among the installed packages; spell the module as "
            "its file is named and start torchrun in the directory holding it, or put that directory on "
            "PYTHONPATH",
        ),
        (
            {"factory": f"{MODELS}:gpt_neo"},
            rf"field 'model.factory': module '{MODELS}' \(.*user_models.py\) has no callable 'gpt_neo' "
            r"\(a close name: 'gpt_neox'\); it defines .*gpt2, gpt_neox, .*token_ce",
        ),
    ],
)
def test_a_usual_mistake_is_one_line_naming_the_field_and_the_fix(
    tmp_path: Path, mistake: dict[str, str], says: str
) -> None:
    raw = spec(tmp_path)
    if "written" in mistake:
        raw["data"]["path"] = token_file(tmp_path / "train.bin", mistake["written"])
    if "dtype" in mistake:
        raw["data"]["dtype"] = mistake["dtype"]
    if "factory" in mistake:
        raw["model"] = {"factory": mistake["factory"]}
    run = run_worker(write_spec(tmp_path, raw))
    assert run.code == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert re.fullmatch("elastrain worker: error: " + says, lines[0]), lines[0]
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").glob("step-*"))
