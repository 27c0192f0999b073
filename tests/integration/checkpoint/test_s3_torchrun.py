"""Checkpoints in S3 under real torchrun, against a real S3-compatible server (SeaweedFS): a
killed rank resumes from the bucket to the same final state as the run on a local directory;
retention applies in the bucket; a kill before the commit is never loaded and its shards are
removed; a rank SIGKILLed mid-upload leaves an open multipart upload, which the next start
aborts; async saves; a flipped byte or a missing shard is refused and the step before used; a
step without a manifest is never loaded; a W=2 checkpoint loads at W=1 and W=3; the offline
commands take s3:// URLs; a missing bucket, refused credentials or no endpoint are one line
naming checkpoint.dir, exit 2."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import botocore.session
import pytest

from tests.integration.checkpoint.conftest import EVERY, SEED, STEPS, Reference
from tests.integration.checkpoint.harness import REPO, Run, cli, env, torchrun, torchrun_cmd
from tests.integration.launch import run_worker, write_spec
from tests.s3server import SeaweedServer
from tests.specs import raw_spec
from tests.waiting import eventually
from worker.checkpoint.remote import collect_unpublished, list_published, read_latest
from worker.checkpoint.storage import storage_for
from worker.checkpoint.verify import logical_digest
from worker.jobspec.location import S3Location


def _env(server: SeaweedServer, **extra: str) -> dict[str, str]:
    """The store's standard variables; the tree on the path (its modules, whichever install)."""
    return {**server.env(), "PYTHONPATH": str(REPO), **extra}


def _prefix() -> S3Location:
    return S3Location("ckpt", f"runs/{uuid.uuid4().hex[:12]}")


@dataclass
class S3Run:
    loc: S3Location
    run: Run


@pytest.fixture(scope="module")
def s3_env(s3server: SeaweedServer) -> Iterator[None]:
    """This process reads the bucket too, with the same variables the workers get."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3server.env().items():
            mp.setenv(k, v)
        yield


@pytest.fixture(scope="module")
def killed_s3(s3server: SeaweedServer, s3_env: None) -> S3Run:
    """W=2 on s3://, rank 0 killed right after the first step it published; one restart."""
    loc = _prefix()
    run = torchrun(
        2, "--dir", str(loc), "--steps", str(STEPS), "--every", str(EVERY), "--seed", str(SEED),
        max_restarts=1, extra_env=_env(s3server, ELASTRAIN_FAILPOINTS="after_latest_update=kill@0^0"),
    ).check()  # fmt: skip
    return S3Run(loc, run)


def test_killed_rank_resumes_from_s3(reference_ddp: Reference, killed_s3: S3Run) -> None:
    loc, run = killed_s3.loc, killed_s3.run
    assert "elastrain failpoint after_latest_update: kill" in run.stderr
    resumed = run.all("resumed")
    assert resumed and resumed[0]["step"] == EVERY and str(resumed[0]["path"]).startswith(str(loc))
    # retention (keep_latest 3) removed the oldest step from the bucket, manifest and shards
    assert [s for s, _ in list_published(loc)] == list(range(EVERY, STEPS + 1, EVERY))[-3:]
    assert storage_for(loc).listing(loc.key(f"step-{EVERY:08d}"))[1] == []
    assert read_latest(loc)[0] == f"step-{STEPS:08d}"
    assert run.last("finished")["digest"] == reference_ddp.digest == logical_digest(str(loc))
    assert not (REPO / "s3:").exists()  # nothing written to a local directory named like the URL
    digest = cli("digest", str(loc))
    assert digest.returncode == 0 and digest.stdout.startswith(reference_ddp.digest), digest.stderr


def test_offline_commands_on_s3_urls(killed_s3: S3Run, reference_ddp: Reference, tmp_path: Path) -> None:
    loc = killed_s3.loc
    inspect = cli("inspect", "--json", str(loc))
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["path"] == f"{loc}/step-{STEPS:08d}"
    verify = cli("verify", str(loc))
    assert verify.returncode == 0 and "every block verified" in verify.stdout, verify.stderr
    export = cli("export-weights", str(loc), str(tmp_path / "weights"))
    assert export.returncode == 0, export.stderr
    marker = json.loads((tmp_path / "weights" / "EXPORT.json").read_text())
    assert marker["source_logical_digest"] == reference_ddp.digest


def test_kill_before_the_commit_is_never_loaded_and_cleaned_up(
    s3server: SeaweedServer, s3_env: None, reference_ddp: Reference
) -> None:
    loc = _prefix()
    # rank 1 dies after uploading its shard of the first save (step 2), before the commit
    run = torchrun(
        2, "--dir", str(loc), "--steps", str(STEPS), "--every", str(EVERY), "--seed", str(SEED),
        max_restarts=1, extra_env=_env(s3server, ELASTRAIN_FAILPOINTS="after_shard_write=kill@1^0"),
    ).check()  # fmt: skip
    assert "elastrain failpoint after_shard_write: kill" in run.stderr
    assert run.all("resumed") == []  # step 2 never committed: the restarted group starts over
    collected = run.all("checkpoint_orphans_collected")
    assert collected and f"step-{EVERY:08d}" in collected[0]["removed"]
    assert run.last("finished")["digest"] == reference_ddp.digest


def test_kill_during_an_upload_is_never_loaded_and_its_upload_aborted(
    s3server: SeaweedServer, s3_env: None, reference_ddp: Reference, tmp_path: Path
) -> None:
    """Rank 1 pauses in the middle of uploading its shard of the first save (step 2) and this
    test SIGKILLs it there: the restarted group starts over (nothing loaded), and its opening
    removes rank 0's shard and aborts rank 1's multipart upload, which no listing of objects
    shows but the store keeps."""
    loc, store, step = _prefix(), storage_for(_prefix()), f"step-{EVERY:08d}"
    args = ("--dir", str(loc), "--steps", str(STEPS), "--every", str(EVERY), "--seed", str(SEED))
    cmd = torchrun_cmd(2, *args, max_restarts=1)
    paused = _env(s3server, ELASTRAIN_FAILPOINTS="during_shard_write=sleep:120@1^0")
    stderr = tmp_path / "stderr.log"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, env=env(paused), stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO)
        try:
            pause = re.compile(r"failpoint during_shard_write: sleep:120 \(pid (\d+)\)")
            found = eventually(
                "rank 1 paused mid-upload", lambda: pause.search(stderr.read_text()), timeout=180
            )
            assert [u.key for u in store.uploads(f"{loc.prefix}/")] == [loc.key(step, "rank-00001.bin")]
            os.kill(int(found.group(1)), signal.SIGKILL)
            out, _ = proc.communicate(timeout=300)
        finally:
            proc.kill()
    run = Run(proc.returncode, out, stderr.read_text()).check()
    assert run.all("resumed") == []  # step 2 never committed: the restarted group starts over
    collected = run.all("checkpoint_orphans_collected")
    assert collected and step in collected[0]["removed"]
    assert store.uploads(f"{loc.prefix}/") == []
    assert run.last("finished")["digest"] == reference_ddp.digest


def test_collecting_after_a_publish_spares_the_steps_after_it(s3server: SeaweedServer, s3_env: None) -> None:
    """After step 4 is published, what saves of earlier steps left (shards without a manifest,
    an open multipart upload) is removed; a later step's save may be in flight and is kept."""
    loc = _prefix()
    store = storage_for(loc)
    ours = botocore.session.get_session().create_client("s3", endpoint_url=s3server.endpoint)
    for step in (2, 6):
        store.write(loc.key(f"step-{step:08d}", "rank-00000.bin"), b"shard")
        ours.create_multipart_upload(Bucket=loc.bucket, Key=loc.key(f"step-{step:08d}", "rank-00001.bin"))
    store.write(loc.key("step-00000004", "manifest.json"), b"{}")  # published, as far as listing goes
    assert collect_unpublished(loc, below=4) == ["step-00000002"]
    assert [u.key for u in store.uploads(f"{loc.prefix}/")] == [loc.key("step-00000006", "rank-00001.bin")]
    _, objects = store.listing(loc.prefix, recursive=True)
    assert sorted(o.key for o in objects) == [loc.key("step-00000004", "manifest.json"),
                                              loc.key("step-00000006", "rank-00000.bin")]  # fmt: skip


def test_async_saves_to_s3(s3server: SeaweedServer, s3_env: None, reference_ddp: Reference) -> None:
    loc = _prefix()
    run = torchrun(
        2, "--dir", str(loc), "--async-save", "--steps", str(STEPS), "--every", str(EVERY),
        "--seed", str(SEED), extra_env=_env(s3server),
    ).check()  # fmt: skip
    assert [e["step"] for e in run.all("checkpoint_published")][-1] == STEPS
    assert all(e["background"] for e in run.all("checkpoint_published"))
    assert run.last("finished")["digest"] == reference_ddp.digest == logical_digest(str(loc))


def _copy(src: S3Location, dst: S3Location, *, skip: str = "") -> None:
    store = storage_for(src)
    _, objects = store.listing(src.prefix, recursive=True)
    for o in objects:
        rel = o.key[len(src.prefix) + 1 :]
        if rel != skip:
            store.write(dst.key(rel), store.read(o.key))


def test_flipped_byte_missing_shard_and_manifestless_step_are_never_loaded(
    s3server: SeaweedServer, killed_s3: S3Run, reference_ddp: Reference
) -> None:
    newest, previous = STEPS, STEPS - EVERY
    flipped, bare, shardless = _prefix(), _prefix(), _prefix()
    for dst in (flipped, bare, shardless):
        _copy(killed_s3.loc, dst)
    store = storage_for(flipped)
    shard = flipped.key(f"step-{newest:08d}", "rank-00001.bin")
    data = bytearray(store.read(shard))
    data[len(data) // 3] ^= 0x10
    store.write(shard, bytes(data))
    assert cli("verify", str(flipped)).returncode == 1
    # a complete step whose manifest never landed: its shards are there, it is not published
    store.delete([bare.key(f"step-{newest:08d}", "manifest.json")])
    # a manifest whose shard is not there
    store.delete([shardless.key(f"step-{newest:08d}", "rank-00000.bin")])
    dirs = f"{flipped},{bare},{shardless}"
    run = torchrun(2, "--phase", "restore-only", "--restore-dirs", dirs, extra_env=_env(s3server)).check()
    assert [r["step"] for r in run.all("restored_from")] == [previous] * 3
    refused = run.all("checkpoint_refused")
    assert len(refused) == 2 and "rank-00001.bin" in refused[0]["reason"]
    assert "block digest mismatch" in refused[0]["reason"]
    assert "rank-00000.bin: shard file is missing" in refused[1]["reason"]
    assert read_latest(flipped)[0] == f"step-{previous:08d}"
    assert [s for s, _ in list_published(flipped)][-1] == previous  # the corrupt one set aside
    assert store.head(flipped.key(f".corrupt-step-{newest:08d}.json")) is not None


@pytest.mark.parametrize("new_world", [1, 3])
def test_reshard_from_s3(
    new_world: int, s3server: SeaweedServer, killed_s3: S3Run, reference_ddp: Reference, tmp_path: Path
) -> None:
    dst = tmp_path / f"w{new_world}"
    jobs = [["ddp", str(killed_s3.loc), str(dst)]]
    run = torchrun(
        new_world,
        "--phase",
        "resave",
        "--jobs",
        json.dumps(jobs),
        "--seed",
        str(SEED),
        extra_env=_env(s3server),
    ).check()
    (event,) = run.all("resaved")
    assert event["step"] == STEPS and event["digest"] == reference_ddp.digest == logical_digest(dst)


@pytest.mark.parametrize(
    ("bucket", "secret", "endpoint", "says"),
    [
        ("nosuchbucket", None, None, "bucket 'nosuchbucket' does not exist at http://127.0.0.1:"),
        ("ckpt", "wrong-secret", None, "the store refused the credentials; set AWS_ACCESS_KEY_ID"),
        ("ckpt", None, "http://127.0.0.1:9", "cannot reach the store at http://127.0.0.1:9"),
    ],
)
def test_bad_store_is_one_line_naming_the_field_exit_2(
    s3server: SeaweedServer, tmp_path: Path, bucket: str, secret: str | None, endpoint: str | None, says: str
) -> None:
    env = _env(s3server)
    env.update({"AWS_SECRET_ACCESS_KEY": secret} if secret else {})
    env.update({"AWS_ENDPOINT_URL": endpoint} if endpoint else {})
    raw = raw_spec("s3-mistake", checkpoint={"dir": f"s3://{bucket}/runs/x"})
    run = run_worker(write_spec(tmp_path, raw), env=env, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.code == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert lines[0].startswith(f"elastrain worker: error: field 'checkpoint.dir': s3://{bucket}/runs/x: ")
    assert says in lines[0], lines[0]
