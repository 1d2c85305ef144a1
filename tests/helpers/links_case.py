"""One rank of ``tests/test_ft_speed.py``'s group-links case: ``python links_case.py RANK WORLD PORT ACTION``. It joins
a gloo group (rank 0 is the test process), connects its group link, prints ``up``, then says goodbye and exits
(ACTION ``bye``) or waits to be killed (``wait``)."""

import importlib.util
import os
import sys
import time

import torch.distributed as dist

# the module by its path: this rank needs torch.distributed only, not lightning_mm's package imports (minutes on a
# loaded 2-core machine)
_spec = importlib.util.spec_from_file_location(
    "links", os.path.join(os.path.dirname(__file__), "..", "..", "lightning_mm", "fault_tolerance", "links.py"))
links_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(links_module)

if __name__ == "__main__":
    rank, world, port, action = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    links = links_module.GroupLinks(rank, world, group=0, on_loss=lambda m: os._exit(3)).start("127.0.0.1")
    print("up", flush=True)
    if action == "bye":
        links.close()
        time.sleep(0.5)
        os._exit(0)
    time.sleep(600)
