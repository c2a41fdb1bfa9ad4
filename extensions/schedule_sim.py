"""schedule_sim.py: a pipeline schedule simulated without processes: its actions and their timeline.

Beyond the BOOST paper (arXiv 2512.12131 §6 runs pipeline parallelism; pipeline.py does, through
torch.distributed.pipelining). What a schedule does, laid out on paper: `order` lists each pp
rank's actions as torch's schedules order them, `timeline` places them in time at a textbook cost
each, `span` and `idle` measure the result. plumbing/explain.py, tools/costmodel.py,
tools/draw.py and tests/test_schedules.py read it.
"""
from extensions.pipeline import MULTI, stages_of


# the textbook's costs of an action, a forward's units: a whole backward twice a forward, split by
# the zero-bubble schedules into the input's gradient and the weights', one each
COST = {"F": 1, "B": 2, "I": 1, "W": 1}


def order(schedule, pp, n_micro, virtual=1):
    """{pp rank: [torch's actions, in the order it runs them]} of a schedule, built without
    processes: 2F1 is stage 2's forward of micro-batch 1; I and W the two halves of a backward B.
    The multi-stage schedules build it themselves (here on stand-in stages); 1F1B and GPipe run a
    loop, written out here as theirs runs: p − rank warm-up forwards, then a backward and a
    forward in turn, then the backwards left (GPipe: every forward, then every backward)."""
    from types import SimpleNamespace
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import _Action, _ComputationType
    if schedule in MULTI:
        v = len(stages_of(0, pp, virtual, schedule))
        stand_ins = [SimpleNamespace(group_rank=0, group_size=pp, num_stages=pp * v, submod=None,
                                     stage_index=k) for k in range(v)]
        return getattr(pipelining, MULTI[schedule])(stand_ins, n_micro).pipeline_order
    out = {}
    for r in range(pp):
        f, b = [_Action(r, _ComputationType("F"), i) for i in range(n_micro)], \
            [_Action(r, _ComputationType("B"), i) for i in range(n_micro)]
        warm = n_micro if schedule == "gpipe" else min(n_micro, pp - r)
        out[r] = f[:warm] + [a for i in range(n_micro - warm) for a in (b[i], f[warm + i])] + \
            b[n_micro - warm:]
    return out


def timeline(actions, cost=COST):
    """{pp rank: [(start, end, action)]}: each rank's actions (`order`) placed in time, each as soon
    as its rank is free and what it needs is done (the stage before's forward of its micro-batch;
    for a backward its own forward and the stage after's backward; for W its I), at `cost` a kind,
    sends free. A model of the schedule, not a measurement: its idle share is `idle`'s."""
    todo = {r: [sub for a in acts if a is not None and a.is_compute_op
                for sub in (a.sub_actions or (a,))] for r, acts in actions.items()}
    last = max(a.stage_index for acts in todo.values() for a in acts)
    done, free, out = {}, dict.fromkeys(todo, 0), {r: [] for r in todo}

    def ready(a):   # when what `a` needs is done, or None while it is not
        s, k, m = a.stage_index, a.computation_type.value, a.microbatch_index
        if k == "F":
            needs = [(s - 1, "F", m)] if s else []
        else:
            needs = [(s, "I", m)] if k == "W" else [(s, "F", m)]
        if k in "BI" and s < last:   # (the stage after's whole backward or its input half)
            needs.append(next((n for n in ((s + 1, "B", m), (s + 1, "I", m)) if n in done),
                              (s + 1, "B", m)))
        return max((done[n] for n in needs), default=0) if all(n in done for n in needs) else None

    while any(todo.values()):
        moved = False
        for r, acts in todo.items():
            while acts and (t := ready(acts[0])) is not None:
                a = acts.pop(0)
                start = max(free[r], t)
                free[r] = done[(a.stage_index, a.computation_type.value, a.microbatch_index)] = \
                    start + cost[a.computation_type.value]
                out[r].append((start, free[r], a))
                moved = True
        if not moved:
            raise RuntimeError("the schedule's actions wait on each other")
    return out


def span(placed):
    """A `timeline`'s length: the step ends with its last action."""
    return max(e for acts in placed.values() for _, e, _ in acts)


def idle(placed):
    """{pp rank: its idle share of the step} of a `timeline`."""
    end = span(placed)
    return {r: 1 - sum(e - s for s, e, _ in acts) / end for r, acts in placed.items()}
