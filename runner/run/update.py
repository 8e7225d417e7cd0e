"""The optimizer update of an accepted step, run one step late so that a step synchronizes the host once.

`loop` is the step loop's state (runner.run.train's _Loop).
"""

from __future__ import annotations

from runner.observe import monitor
from runner.run import evaluate, ft


def apply(loop) -> None:
    """The optimizer step of the last step, once the guard accepted it. It runs one step late, at the start of the next
    step (or at once when something reads the weights: decide): the verdict needs the global loss and grad norm on the
    host, which costs the step's one host synchronization (DevicePolicy.read); run after the verdict in the same step,
    the update would need a second one before dt. So a step's dt holds one update and one forward/backward, and a spike
    still never reaches the weights."""
    if not loop.pending:
        return
    loop.pending = False
    loop.ckpt.staged()  # an async checkpoint's copy of the weights is taken before they change
    with loop.mon.phase("optimizer"):
        loop.opt.step()
    loop.opt.zero_grad(set_to_none=True)
    loop.sched.step()


def reads_weights(loop, step: int, stop: bool) -> bool:
    """Whether anything reads the weights after `step` before the next step updates them. Under torchft the next
    step's quorum may send them to a recovering group, so the update is never deferred there."""
    cfg = loop.cfg
    evaluating = loop.eval_data is not None and evaluate.due(cfg.eval.interval, step, cfg.training.steps)
    due = step >= cfg.training.steps or stop or evaluating or loop.ckpt.due(step) or loop.integrity.check_due(step)
    return due or loop.ft is not ft.OFF


def decide(loop, step: int, verdict: monitor.Verdict, stop: bool, committed: bool) -> None:
    """An accepted step's update waits for the next step (apply); a spike's gradients are dropped now, and so are
    a step's that torchft's quorum did not commit (its schedule does not advance either)."""
    loop.pending = verdict.action == "ok" and committed
    if not loop.pending:
        loop.opt.zero_grad(set_to_none=True)  # a spike's gradients never reach the weights
        if committed:
            loop.sched.step()
    elif reads_weights(loop, step, stop):
        apply(loop)
