"""One rank of a job the local-tier tests kill (run by tier_helpers.run_killed):
``tier_worker.py RANK WORLD PORT SCENARIO TMP``. Scenario ``save<N>``: local saves of steps 10, 20, ... up
to N; before the last one, the victim (given ``LDC_TIER_ARM=ENV=VALUE`` by the parent) sets ENV=VALUE, a
kill point, in its environment. Scenario ``recover``: a restarted job's recovery, the victim armed from
the start."""

import datetime
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tier_helpers import options, state  # noqa: E402

from lightning_distckpt.tiers import LocalTier  # noqa: E402


def _arm() -> None:
    """Set the kill point the parent gave this process (the victim only)."""
    if os.environ.get("LDC_TIER_ARM"):
        name, value = os.environ["LDC_TIER_ARM"].split("=", 1)
        os.environ[name] = value


def main() -> None:
    rank, world, port, scenario, tmp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    tier = LocalTier(options(tmp))
    if scenario == "recover":  # a restarted job, armed from the start: killed while completing its copies
        _arm()
        tier.load(state(rank, world, 0, template=True), tier.recoverable())
        print(f"rank {rank}: recovered", flush=True)
        return
    last = int(scenario[len("save"):])
    for step in range(10, last + 1, 10):
        if step == last:
            _arm()
        tier.save(state(rank, world, step), step)
        tier.wait()
    print(f"rank {rank}: all saves done", flush=True)


if __name__ == "__main__":
    main()
