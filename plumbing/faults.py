"""faults.py: --inject_fault=kind:N, the failures the tests provoke on purpose, as hooks.

Beyond the BOOST paper (arXiv 2512.12131; a run's safety, docs/safe-runs.md): train.py's loop calls
three hooks of a `Faults`, each nothing unless --inject_fault names it for this step:
- nan:N           step N's loss made NaN (the non-finite guard must skip that update);
- kill_in_save:N  the process dies halfway through writing step N's checkpoint (the previous one
                  must survive whole);
- kill:N          the last rank dies after step N's evaluation (torchrun --max-restarts restarts
                  the group, which resumes from the last checkpoint).
A group torchrun restarted injects nothing, so the restarted run finishes. And one real fault:
lost_peer, the line a surviving rank says when another rank of its job died.
"""
import os
import sys

from plumbing.rundir import checkpoint_folders, tell_torchrun


class Faults:
    def __init__(self, tc, last_rank):
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        kind, _, at = tc.inject_fault.partition(":")   # (options checked kind:N)
        self.kind, self.at = (kind, int(at)) if kind and not restarted else ("", -1)
        self.last_rank = last_rank

    def _now(self, kind, iter_num):
        return self.kind == kind and self.at == iter_num

    def poison(self, loss, iter_num):
        """nan:N: the loss of step N times NaN, so its gradients are NaN on every rank."""
        return loss * float("nan") if self._now("nan", iter_num) else loss

    def in_save(self, iter_num):
        """kill_in_save:N: what the checkpoint at N calls between writing and publishing it."""
        return (lambda: os._exit(1)) if self._now("kill_in_save", iter_num) else None

    def after_eval(self, iter_num):
        """kill:N: the last rank dies here, at step N, after its evaluation and checkpoint."""
        if self._now("kill", iter_num) and self.last_rank:
            os._exit(1)


# what gloo and NCCL say when a peer process is gone (killed, crashed, its machine lost)
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
             "remote process exited", "NCCL communicator was aborted")


def lost_peer(e, world, out_dir):
    """The one line a rank says for `e` where a collective failed because another rank of the job
    died (kill -9, a crash, a lost machine): which rank (the other one of two; else torchrun's
    report names it), the newest checkpoint, how to go on; None for any other error. Nothing is
    lost: the checkpoints are written whole or not at all."""
    if world == 1 or not any(phrase in str(e) for phrase in PEER_GONE):
        return None
    me = int(os.environ.get("RANK", "0"))
    who = f"rank {1 - me}" if world == 2 else "a rank (torchrun's report names it)"
    found = sorted(d for d in checkpoint_folders(out_dir) if not d.endswith(".tmp"))
    last = f"the last checkpoint is {found[-1]}" if found else "no checkpoint was saved yet"
    return (f"rank {me}: {who} of this job died, so a collective failed; {last}; continue with "
            "the same command and --init_from=resume (torchrun --max-restarts=N restarts the "
            "group by itself)")


def exit_if_peer_lost(e, world, out_dir):
    """Where `e` is lost_peer's case: its line on stderr and for torchrun's summary, exit 1."""
    said = lost_peer(e, world, out_dir)
    if said is not None:
        print(f"error: {said}", file=sys.stderr)   # (every surviving rank: one line)
        tell_torchrun(f"error: {said}")
        sys.exit(1)
