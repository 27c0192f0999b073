"""A worker that only arms the lifeline and idles ("trains") until killed; torchrun starts it.
argv: REPORT_PATH MODE (both: worker.start.lifeline.install; watchdog: the getppid thread alone). Its
last words (the agent's end as the lifeline saw it) go to REPORT_PATH + ".bye", with the looks
that bracket it (the last that found the agent alive, the first that found it dying) after them."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from worker.start import lifeline
from worker.start.lifeline import install, on_last_words, watch

report, mode = sys.argv[1], sys.argv[2]


def bye(when: float) -> None:
    sight = lifeline._sight
    bracket = {"alive_at": sight.alive_at, "dying_at": sight.dying_at} if sight is not None else {}
    with open(report + ".bye", "w") as f:
        json.dump({"at": when, **bracket}, f)


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
