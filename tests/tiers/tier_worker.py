"""One rank of a job the local-tier tests kill (run by tier_helpers.run_killed):
``tier_worker.py RANK WORLD PORT SCENARIO TMP``. Scenario ``save<N>:<ENV>=<VALUE>``: local saves of steps
10, 20, ... up to N; before the last one, this process sets ENV=VALUE (a kill point) in its environment
when the parent gave it ``LDC_TIER_ARM`` (only the victim gets it)."""

import datetime
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tier_helpers import options, state  # noqa: E402

from lightning_distckpt.tiers import LocalTier  # noqa: E402


def main() -> None:
    rank, world, port, scenario, tmp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    last = int(scenario.split(":")[0][len("save"):])
    tier = LocalTier(options(tmp))
    for step in range(10, last + 1, 10):
        if step == last and os.environ.get("LDC_TIER_ARM"):
            name, value = os.environ["LDC_TIER_ARM"].split("=", 1)
            os.environ[name] = value
        tier.save(state(rank, world, step), step)
        tier.wait()
    print(f"rank {rank}: all saves done", flush=True)


if __name__ == "__main__":
    main()
