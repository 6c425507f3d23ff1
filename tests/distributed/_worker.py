"""One rank of a test launched by ``conftest.launch_ranks``; not a test module.

Usage (by the launcher): ``_worker.py MODULE:FUNCTION JSON_KWARGS`` with RANK,
WORLD_SIZE, RECOMP_TEST_INIT (a ``file://`` init method) and RECOMP_TEST_OUT
(a directory) in the environment. Calls ``FUNCTION(rank, world_size, **kwargs)``
inside an initialised gloo process group and writes its JSON-serialisable
result to ``RECOMP_TEST_OUT/rank<r>.json``.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys


def main() -> None:
    target, kwargs = sys.argv[1], json.loads(sys.argv[2])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_dir = os.environ["RECOMP_TEST_OUT"]

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=os.environ["RECOMP_TEST_INIT"],
        rank=rank,
        world_size=world_size,
        # A rank that waits longer than this for its peer fails instead of hanging.
        timeout=datetime.timedelta(seconds=int(os.environ.get("RECOMP_TEST_PG_TIMEOUT", "60"))),
    )
    try:
        module_name, function_name = target.split(":")
        result = getattr(importlib.import_module(module_name), function_name)(
            rank, world_size, **kwargs
        )
        path = os.path.join(out_dir, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)
        # Both ranks past their last collective before either tears the group down:
        # a peer closing its gloo connections while the other still completes a
        # send makes gloo's I/O thread abort ("terminate called ...").
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
