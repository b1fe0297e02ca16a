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
