"""TEST-ONLY (distributed.audit_collectives): every torch.distributed collective the runner's own modules call, with the
group and the tensors' device it used, so the suite proves on CPU (distributed.host_group=dedicated) that no runner
collective bypasses the device policy (runner.run.device).
"""

from __future__ import annotations

import inspect
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner.run import device
from runner.run.device import DevicePolicy

RUNNER_ROOT = Path(__file__).resolve().parent.parent

AUDITED = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast", "broadcast_object_list", "barrier")


@contextmanager
def audit(policy: DevicePolicy, out: Path):
    """TEST-ONLY (distributed.audit_collectives): record every torch.distributed collective the runner's own
    modules call, with the group and tensor device it used, into `out` (one JSON list per rank)."""
    calls: list[dict[str, Any]] = []
    # private_api: torch_distributed_collectives
    originals = {name: getattr(dist, name) for name in AUDITED}

    here = Path(device.__file__).resolve()  # a collective the policy calls is the policy's caller's

    def wrap(name: str, fn):
        def recorded(*args, **kwargs):
            frames = [Path(f.filename).resolve() for f in inspect.stack(0)[1:4]]
            via_policy = frames[0] == here
            caller = inspect.stack(0)[2 if via_policy else 1]
            path = Path(caller.filename).resolve()
            if path.is_relative_to(RUNNER_ROOT):
                group = kwargs.get("group")
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                tensors += [x for a in args if isinstance(a, list) for x in a if isinstance(x, torch.Tensor)]
                calls.append(
                    {
                        "op": name,
                        "caller": f"{path.relative_to(RUNNER_ROOT.parent).as_posix()}:{caller.function}",
                        "via_policy": via_policy,
                        "group": "host" if group is not None and group is policy.host_group else "default" if group is None else "other",
                        "devices": sorted({t.device.type for t in tensors}),
                    }
                )
            return fn(*args, **kwargs)

        return recorded

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(calls, indent=1) + "\n")
