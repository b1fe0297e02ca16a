"""The main loop the scenario scripts share: run the named scenarios, write this rank's results
(or the traceback) to ``<out>.rank<N>.json`` whatever happens, and leave the process group together."""

from __future__ import annotations

import argparse
import json
import os
import traceback
from typing import Any, Callable, Dict

import torch

Scenario = Callable[[argparse.Namespace, Dict[str, Any]], None]


def run_scenarios(scenarios: Dict[str, Scenario], args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    res: Dict[str, Any] = {}
    try:
        for name in args.scenarios:
            scenarios[name](args, res)
    except BaseException:
        res["error"] = traceback.format_exc()
        raise
    finally:
        rank = int(os.environ.get("LOCAL_RANK", 0))
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(res, f, default=str)
    if "error" not in res and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # leave together: no rank exits while another still talks to it
        torch.distributed.destroy_process_group()


def scenario_main(scenarios: Dict[str, Scenario], **options: Dict[str, Any]) -> None:
    """The command line every scenario script takes: ``SCENARIO... --dir D --out O [--devices N]
    [--tp N]``, plus the script's own ``options`` (``"--name": add_argument keywords``); then run."""
    p = argparse.ArgumentParser()
    p.add_argument("scenarios", nargs="+", choices=sorted(scenarios))
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    for flag, kwargs in options.items():
        p.add_argument(flag, **kwargs)
    run_scenarios(scenarios, p.parse_args())
