"""CheckedLauncher with a plain function: ``raise`` spawns one child rank (a copy of this command line) and then
raises in the launching process; ``orphan`` spawns one child and exits at once without ending it. The child
writes its pid to ``<dir>/child.pid`` and sleeps. Used by tests/test_launch_errors.py."""

import os
import sys
import time

from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_mm.trainer.launch import CheckedLauncher

mode, folder = sys.argv[1], sys.argv[2]


def work():
    if os.environ.get("LOCAL_RANK", "0") != "0":
        with open(os.path.join(folder, "child.pid"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(300)
        return
    while not os.path.exists(os.path.join(folder, "child.pid")):
        time.sleep(0.1)
    if mode == "orphan":
        os._exit(0)
    raise RuntimeError("the launching rank failed")


launcher = CheckedLauncher(LightningEnvironment(), num_processes=2, num_nodes=1, check=lambda: None)
launcher.grace = 1.0
launcher.launch(work)
