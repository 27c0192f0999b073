"""A run's output: whether its final step is kept, and why a save failed (pure, torch-free).

A run with checkpointing on ends with its final step published: that checkpoint is the run's
output (what ``elastrain checkpoint export`` reads, what a longer run resumes from). A run whose
final save aborted has trained steps nobody can load, so it does not end as a success: its
workers exit non-zero with :func:`unpublished_final`'s line, which names the error, the
directory and the newest step that is published there. Earlier saves that abort are skipped and
training goes on (the next save may succeed); the final one has no next save.

The control plane imports this module (a full volume is counted there too).
"""

from __future__ import annotations

import errno
import os

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""A full volume, or a full quota on it: a retry in the same place fails the same way."""
_NO_SPACE_WORDS = tuple(os.strerror(code) for code in NO_SPACE_ERRNOS) + tuple(
    f"[Errno {code}]" for code in NO_SPACE_ERRNOS
)


def no_space(reason: str) -> bool:
    """Whether a save's abort ``reason`` (the words of an OSError, as a rank reported it) says
    that a volume or a quota was full."""
    return any(word in reason for word in _NO_SPACE_WORDS)


def unpublished_final(
    *, final_step: int, newest_published: int | None, reason: str | None, job_dir: str
) -> str | None:
    """None when the final step is published in ``job_dir`` (``newest_published`` is the
    newest step published there, None for none); else one line for a person: the step, the
    directory, the error (``reason``: the final save's abort, None when unknown), the newest
    published step and what to do."""
    if newest_published is not None and newest_published >= final_step:
        return None
    why = reason or "its save did not complete"
    if newest_published is None:
        kept = f"no checkpoint of this run is published in {job_dir}"
    else:
        lost = final_step - newest_published
        kept = f"the newest published checkpoint is step {newest_published} ({lost} steps are not saved)"
    return (
        f"the final checkpoint (step {final_step}) could not be published in {job_dir}: {why}; {kept}; "
        "free space there (or point checkpoint.dir at a larger volume) and run the job again: it "
        "resumes from the newest published step"
    )
