"""Host syncs per optimizer step, counted in every rank that scripts/gpu_check_node.py starts (this folder is first on
their PYTHONPATH, so Python imports this module at start-up); without GPU_CHECK_SYNC_DIR it does nothing.

Counted, without the profiler: the implicit syncs torch's sync debug mode reports (torch.cuda.set_sync_debug_mode("warn"):
device-to-host copies such as .item(), .cpu(), float() of a CUDA tensor, nonzero, and stream synchronizes), set on the
first optimizer step, once CUDA is up in the rank; and the explicit torch.cuda.synchronize() and Event.synchronize()
calls, which c10 does not report (device and event synchronizes bypass its check). torch says the debug mode does
not cover every synchronizing op (torch.distributed's among them), so this is a lower bound. The count between two
optimizer steps is written to <GPU_CHECK_SYNC_DIR>/rank_<RANK>.json after every step (the runner's ranks leave through
os._exit, so nothing waits for exit)."""

import os

_DIR = os.environ.get("GPU_CHECK_SYNC_DIR")
_MESSAGE = "called a synchronizing CUDA operation"

if _DIR and "RANK" in os.environ:
    import json
    import warnings
    from pathlib import Path

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _count, _per_step, _armed = [0], [], [False]
    _show = warnings.showwarning

    def _counted(message, category, filename, lineno, file=None, line=None):
        if _MESSAGE in str(message):
            _count[0] += 1
            return
        _show(message, category, filename, lineno, file, line)

    def _explicit(fn):
        def wrapped(*args, **kwargs):
            _count[0] += 1
            return fn(*args, **kwargs)

        return wrapped

    torch.cuda.synchronize = _explicit(torch.cuda.synchronize)
    torch.cuda.Event.synchronize = _explicit(torch.cuda.Event.synchronize)

    def _after_step(optimizer, args, kwargs):
        if not _armed[0]:  # first step: CUDA is initialized in this rank by now
            torch.cuda.set_sync_debug_mode("warn")
            warnings.showwarning, _armed[0] = _counted, True
        if not any(f[0] == "always" and f[1] is not None and f[1].pattern.startswith(_MESSAGE) for f in warnings.filters):
            warnings.filterwarnings("always", message=_MESSAGE)  # every occurrence, not once per call site
        _per_step.append(_count[0])
        _count[0] = 0
        out = Path(_DIR) / f"rank_{os.environ['RANK']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rank": int(os.environ["RANK"]), "per_step": _per_step}))

    _handle = register_optimizer_step_post_hook(_after_step)
