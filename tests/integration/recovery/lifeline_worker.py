"""A worker that only arms the lifeline and idles ("trains") until killed; torchrun starts it.
argv: REPORT_PATH MODE (both: worker.lifeline.install; watchdog: the getppid thread alone). Its
last words (the agent's end as the lifeline saw it) go to REPORT_PATH + ".bye"."""

from __future__ import annotations

import os
import sys
import threading
import time

from worker.lifeline import install, on_last_words, watch

report, mode = sys.argv[1], sys.argv[2]


def bye(when: float) -> None:
    with open(report + ".bye", "w") as f:
        f.write(repr(when))


on_last_words(bye)
if mode == "both":
    install(poll_s=1.0)
else:
    threading.Thread(target=watch, args=(os.getppid(),), kwargs={"poll_s": 0.2}, daemon=True).start()
with open(report + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(report + ".tmp", report)
while True:
    time.sleep(0.05)
