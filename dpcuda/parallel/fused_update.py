"""The one-call step's update by a dpcuda.optim optimizer, fused into the replicas' reduction
(torch.ops.dpcuda.reduce_update_): each replica reduces the shard of the gradients it owns
(the two_shot split) and updates that shard's weights with that shard's optimizer state. The
optimizer state is sharded (ZeRO-1): replica k keeps the state of shard k only. The new weights
land in replica 0 (the model); the other replicas take them at the next forward.

Here every replica shares one device (the CPU, or one GPU), so the shards are slices of one
flat buffer per state tensor (exp_avg, ...) laid out as the replicas' flat parameters, and the
optimizer's own state entries (opt.state[p]["exp_avg"], ...) are views of it, as are Adam's
step counts (0-d views of one float32 tensor on the replicas' device, as torch's capturable
Adam keeps them): its state_dict() is torch's format and always current, and a
load_state_dict() is followed at the next step.

The step counts and whether SGD's momentum has begun are kept on the device and written into
the hyperparameter arrays there (Adam's bias corrections follow from the count in the kernel),
so that an update the device skips (DataParallel's non-blocking step: a record that says
NaN/Inf) counts no step, with no host read.
"""

import itertools
import operator

import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks  # (a dict torch fills in place)

from .. import _C
from ..optim import _HYPER, _FusedOptimizer
from .unchanged import ATTR_IS, ITEM_IS, KEYS, items_of


def shard_range(n, replicas, k, align):
    """csrc/cpu/all_reduce.h's shard_range: replica k's two_shot shard [begin, end)."""
    per = -(-n // replicas)
    per = -(-per // align) * align
    begin = min(per * k, n)
    return begin, min(per * k + per, n)


def plan_key(opt, generation, structure):
    """What a plan over an optimizer is made for: the optimizer, the replicas' build, the kind
    of state, and the parameter groups' members in order."""
    members = [group["params"] for group in opt.param_groups]
    return (id(opt), generation, structure,
            tuple(map(id, itertools.chain.from_iterable(members))), tuple(map(len, members)))


def group_of_trainable(opt, r0):
    """The parameter group of each trainable parameter of replica r0, in its flat order; None
    unless the optimizer holds exactly those parameters."""
    group_of = {}
    for g, group in enumerate(opt.param_groups):
        for p in group["params"]:
            group_of[id(p)] = g
    params = [r0.params[i] for i in r0.trainable]
    if len(group_of) != len(params) or any(id(p) not in group_of for p in params):
        return None
    return [group_of[id(p)] for p in params]


def group_segments(spans, group_of, begin=0, end=None):
    """reduce_update_'s segments for the flat range [begin, end) (end None: to the last
    parameter): the parameters' spans cut to it, merged where neighbours share a group, as flat
    (begin, end, group) triples counted from `begin`."""
    segments = []
    for (o, c), g in zip(spans, group_of):
        lo, hi = max(o, begin), o + c if end is None else min(o + c, end)
        if hi <= lo:
            continue
        lo, hi = lo - begin, hi - begin
        if segments and segments[-1][2] == g and segments[-1][1] == lo:
            segments[-1][1] = hi
        else:
            segments.append([lo, hi, g])
    return [v for s in segments for v in s]


def _same_objects(a, b):
    """Whether two tuples hold the same objects, position by position."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


_PLAIN = (float, int, bool, str, type(None))


def _immutable_values(group):
    """Whether a parameter group's hyperparameters (every entry but its params) are values no
    one can change in place: numbers, strings, None, tuples of them (not a tensor lr, not a
    list of betas)."""
    return all(type(v) in _PLAIN or (type(v) is tuple and all(type(e) in _PLAIN for e in v))
               for k, v in group.items() if k != "params")


class _Plan:
    """What stays the same from step to step for one optimizer over one replica set: the
    state's flat buffers and their views, the shards, the parameter groups as segments."""

    def __init__(self, opt, replicas, keys, group_of):
        r0 = replicas[0]
        params = [r0.params[i] for i in r0.trainable]
        n = r0.flat_param.numel()
        R = len(replicas)
        self.params, self.keys, self.group_of = params, keys, group_of
        self.flat = {k: torch.zeros(n, dtype=r0.flat_param.dtype, device=r0.device)
                     for k in keys}
        self.views = {k: [self.flat[k][o:o + c].view_as(p) for (o, c), p in
                          zip(r0.spans, params)] for k in keys}
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=r0.device)
        self.step_views = list(self.steps.unbind())
        # What an update changes in place, whose versions finish() advances as torch.optim's
        # in-place ops do: the weights, and Adam's step counts (the views share one counter).
        self.versioned = params + ([self.steps] if opt._op == "adam" else [])
        G = len(opt.param_groups)
        # Each group's hyperparameter array (reduce_update_ reads row g), its first member (whose
        # step count stands for the group's), and whether SGD's momentum has begun in it.
        self.hyper = torch.zeros(G, _HYPER, dtype=torch.float64, device=r0.device)
        # The host's copy that write_hyper fills in place (numpy: no tensor made per step) and
        # copies from: a step allocates nothing for its hyperparameters.
        self.hyper_host = torch.zeros(G, _HYPER, dtype=torch.float64)
        self.hyper_rows = self.hyper_host.numpy()  # (its memory, as numpy)
        # The host's values on the device, which every update copies into hyper first (a graphed
        # step's graph at each replay); the host writes it only when they change (a scheduler's
        # step), so that a step or a replay with the same values makes no host-to-device copy
        # and, with the same objects in the groups, no host arithmetic. written: its bytes.
        self.hyper_base = torch.zeros_like(self.hyper)
        self.written = None
        # reduce_update_'s hyperparameters, group by group, one row per replica: of hyper_base
        # (the host's rows, where the device completes nothing) and of hyper
        self.base_rows, self.completed_rows = (
            [rows[g] for g in range(G) for _ in range(R)] for rows in (self.hyper_base, self.hyper))
        self.inputs = None  # write_hyper's memo: each group's entries at its last write
        self.firsts = [min((i for i, x in enumerate(group_of) if x == g), default=-1)
                       for g in range(G)]
        self.first_index = torch.tensor([max(f, 0) for f in self.firsts], device=r0.device)
        self.started = torch.zeros(G, dtype=torch.float32, device=r0.device)
        align = 16 // r0.flat_param.element_size()
        bounds = [shard_range(n, R, k, align) for k in range(R)]
        shards = [[self.flat[k][b:e] for b, e in bounds] for k in keys]
        self.lists = [shards[i] if len(shards) > i else [] for i in range(3)]
        self.segments = group_segments(r0.spans, group_of)
        self.members = [[i for i, g in enumerate(group_of) if g == index]
                        for index in range(len(opt.param_groups))]
        self.buffers = [r.flat_param for r in replicas], [r.flat_grad for r in replicas]
        self.device = r0.device
        self.bound = False
        self.seen = ()  # the optimizer's state as bind() and finish() left it (see_state)

    def bind(self, opt):
        """The optimizer's state entries as views of the flat buffers (values it holds that
        are not, from a loaded state_dict or its own steps, copied in first); whether each
        group is at one point (is_uniform) and which groups' momentum has begun, read once
        here (the plan's own updates keep them, and settle() makes the next step bind again
        after anything else changes the state)."""
        adam = opt._op == "adam"
        with torch.no_grad():
            # (SGD without momentum has no state: no entry is made, as torch.optim makes none)
            for i, p in enumerate(self.params if adam or self.keys else ()):
                state = opt.state[p]
                for k in self.keys:
                    view = self.views[k][i]
                    have = state.get(k)
                    if have is view:
                        continue
                    if have is None:
                        # torch.optim's lazy state starts at zero; SGD's momentum buffer is
                        # made by its first update (until then, its absence says "first").
                        view.zero_()
                        if adam:
                            state[k] = view
                    else:
                        view.copy_(have)
                        state[k] = view
                if adam:
                    view = self.step_views[i]
                    have = state.get("step")
                    if have is not view:
                        view.fill_(0.0 if have is None else float(have))
                        state["step"] = view
            if not adam and self.keys:
                self.started.copy_(torch.tensor(
                    [f >= 0 and "momentum_buffer" in opt.state[self.params[f]]
                     for f in self.firsts], dtype=torch.float32))
        self.bound = True
        self.is_uniform = self.uniform(opt)
        self.see_state(opt)
        # (the optimizer calls it before its own step() and its state_dict())
        opt.__dict__["_plan_settle"] = self.settle

    def settle(self, opt):
        """Before the optimizer's own step() (a step with an unused parameter, a pre-hook, a
        call of the user's) or its state_dict(): what the device knows made the optimizer's.
        SGD's momentum buffers of the groups whose momentum the device has not begun (their
        first update was skipped there) are dropped, as torch would have none; and the next
        fused step binds afresh (the own step may advance some step counts, or begin
        buffers). A host read on a GPU; those paths read the host already."""
        if not self.bound:
            return
        if opt._op == "sgd" and self.keys:
            started = self.started.tolist()
            views = self.views["momentum_buffer"]
            for g, members in enumerate(self.members):
                if started[g]:
                    continue
                for i in members:
                    state = opt.state.get(self.params[i])
                    if state is not None and state.get("momentum_buffer") is views[i]:
                        del state["momentum_buffer"]
        self.bound = False

    def see_state(self, opt):
        """What the plan reads of the optimizer's state, as it is now, as checks of
        dpcuda._C._unchanged (FusedUpdate.recheck compares): opt.state and its entries, each
        of the plan's parameters' state dicts (their keys: a value of another entry, a
        subclass's own, is free) and their entries of the plan's kind (the same objects)."""
        state = opt.state
        seen = [(ATTR_IS, opt, "state", state), items_of(state)]
        names = self.keys + (("step",) if opt._op == "adam" else ())
        for s in map(state.get, self.params):
            if s is None:
                continue
            seen.append((KEYS, s, None, tuple(s)))
            seen += [(ITEM_IS, s, k, s[k]) for k in names if k in s]
        self.seen = tuple(seen)

    def uniform(self, opt):
        """Whether each group's parameters are at the same point (Adam: the same step count;
        SGD: all with a momentum buffer, or all without), as one update per group needs. A
        parameter that missed steps (no gradient, frozen for a while) makes them differ."""
        if opt._op == "adam":
            steps = self.steps.tolist()
            return all(len({steps[i] for i in m}) <= 1 for m in self.members)
        state = opt.state
        return all(len({"momentum_buffer" in state.get(self.params[i], ()) for i in m}) <= 1
                   for m in self.members)

    def current(self, opt):
        """Whether the optimizer's state entries are still the plan's views (a load_state_dict
        or a user's assignment replaces them)."""
        if not self.keys and opt._op != "adam":
            return True  # (SGD without momentum: no state the plan holds)
        states = list(map(opt.state.get, self.params))
        if None in states:
            return False
        for k in self.keys:
            if not all(map(operator.is_, map(dict.get, states, itertools.repeat(k)),
                           self.views[k])):
                return False
        return opt._op != "adam" or all(map(
            operator.is_, map(dict.get, states, itertools.repeat("step")), self.step_views))


def _changed_in_step(opt, what):
    return RuntimeError(
        f"dpcuda: {type(opt).__name__}.step() (a subclass's, or a wrapper's) left {what} "
        f"inside DataParallel.step, whose update is fused into its reduction and was set up "
        f"before it; nothing was updated. Make such changes before dp.step(), where the step "
        f"checks them")


class FusedUpdate:
    """The fused update of one dpcuda.optim optimizer over one replica set: ready() says
    whether a step can take this path, update() runs it."""

    def __init__(self):
        self._plan = None
        self._plan_key = None
        self.issued = False  # whether the last update() queued its reduce-update
        self._first = []

    @staticmethod
    def _structure(opt, group):
        if opt._op == "sgd":
            return ("momentum_buffer",) if group["momentum"] != 0 else ()
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def ready(self, opt, replicas, unused, generation):
        """Whether the fused update applies: a dpcuda.optim optimizer without step pre-hooks
        (they would read or change .grad) over exactly the trainable parameters, one kind of
        state in every group, the replicas on one device, every parameter with a gradient and
        the step counts of each group alike. Otherwise the step reduces and then calls
        opt.step() (as exact, slower)."""
        if not isinstance(opt, _FusedOptimizer) or unused or opt._optimizer_step_pre_hooks \
                or _global_optimizer_pre_hooks:
            return False
        if len(replicas) > 1 and len({r.device for r in replicas}) != 1:
            return False  # (shards on several devices: not yet; see the module docstring)
        groups = opt.param_groups
        structure = {self._structure(opt, group) for group in groups}
        if len(structure) != 1:
            return False
        key = plan_key(opt, generation, structure.pop())
        if key != self._plan_key:
            self._plan = None
            group_of = group_of_trainable(opt, replicas[0])
            if group_of is None:
                self._plan_key = key
                return False
            self._plan = _Plan(opt, replicas, key[2], group_of)
            self._plan_key = key
        plan = self._plan
        if plan is None:
            return False
        if not plan.bound or not plan.current(opt):
            plan.bind(opt)
        elif plan.device.type == "cpu":
            # (a state changed in place: on the CPU this costs nothing; on a GPU it would be a
            # host read every step, and the plan's own updates keep each group alike)
            plan.is_uniform = plan.uniform(opt)
        return plan.is_uniform

    def update(self, opt, replicas, algorithm, records=(), scaled_by=0.0, loss_out=None):
        """The fused reduce-update of the replicas' gradients (flat_grad) into every replica's
        weights; the optimizer's state and step counts advanced as its step() would advance
        them; .grad None on every replica (no replica holds the global gradient).

        records, scaled_by, loss_out: the replicas' step_status records, which the update
        obeys on the device (reduce_update_: skipped for NaN/Inf or a bad label, with no step
        counted and no momentum begun; the gradient rescaled by scaled_by / the rows they
        count; the step's loss into loss_out), for a step that does not read them first.

        Three parts, which a graphed step (graphed.py) runs apart: write_hyper (the host's
        values into the plan's device array), device_update (device work only: what a graph
        captures) and finish (the host's bookkeeping after an update)."""
        self.issued = False
        for r in replicas:
            r.drop_grads()

        def run():
            # (inside opt.step(): after what a subclass's step or a wrapper of it changes)
            self.recheck(opt)
            self.write_hyper(opt)
            self.device_update(opt, algorithm, records, scaled_by, loss_out)
            self.finish(opt)
        # Through opt.step(), so that what wraps it runs as for any step: its post-hooks, the
        # learning-rate schedulers' bookkeeping, the profiler's record.
        opt._fused_step = run
        try:
            opt.step()
        finally:
            opt.__dict__.pop("_fused_step", None)

    def recheck(self, opt):
        """Inside opt.step(), before the update: where the optimizer's own step (a subclass's,
        a wrapper's) changed its state after ready() bound the plan (a momentum buffer dropped,
        a state entry replaced), the plan binds it again, so that the update starts SGD's
        momentum afresh where torch would and takes the values put in; a group whose
        parameters are then at different points raises (one update per group cannot apply;
        nothing was updated). One C call when nothing changed."""
        plan = self._plan
        if _C._unchanged(plan.seen):
            # (SGD's momentum buffers' presence is in seen; Adam's step counts on the CPU are
            # values, read as ready() reads them; on a GPU the plan's own updates keep them)
            if plan.device.type != "cpu" or opt._op != "adam" or plan.uniform(opt):
                return
        else:
            # (settled first: the groups whose momentum the device has not begun drop their
            # buffers, as bind() reads "begun" from their presence)
            plan.settle(opt)
            plan.bind(opt)
            if plan.is_uniform:
                return
        raise _changed_in_step(opt, "the parameters of a group at different points (some "
                                    "with a momentum buffer or a step count, some without, "
                                    "or with other step counts)")

    def write_hyper(self, opt):
        """Each group's hyperparameters (as the optimizer holds them now: a scheduler's lr)
        into the plan's device copy of them (hyper_base), which device_update completes into
        hyper (Adam's step, SGD's first-step flag), only when they changed since it was last
        written: the same objects in every group's entries as at the last write skip even the
        host's arithmetic (plan.inputs; kept only where the entries are immutable values, whose
        objects cannot change in place), and the same bits skip the copy."""
        plan = self._plan
        adam = opt._op == "adam"
        state = opt.state
        # SGD: the groups whose momentum buffers this update makes
        self._first = [] if adam or not plan.keys else [
            index for index, m in enumerate(plan.members)
            if m and "momentum_buffer" not in state[plan.params[m[0]]]]
        inputs = [tuple(group.values()) for group in opt.param_groups]
        last = plan.inputs
        if last is not None and len(inputs) == len(last) and all(map(_same_objects, inputs, last)):
            return
        groups = opt.param_groups
        if len(groups) != len(plan.members):
            raise _changed_in_step(opt, "another number of parameter groups")
        rows = []
        for index, group in enumerate(groups):
            if not plan.members[index]:
                rows.append([0.0] * _HYPER)
                continue
            # (the plan's kind of state, which ready() checked: changed since, it was changed
            # inside opt.step(); the values' memo above holds only where no entry changed)
            if self._structure(opt, group) != plan.keys:
                raise _changed_in_step(opt, "another kind of state in a group (SGD's "
                                            "momentum 0 or not, Adam's amsgrad)")
            rows.append(opt._values(group, 0.0 if adam else False))
        plan.hyper_rows[:] = rows
        # (compared by their bits: -0.0 is not 0.0 here, and a NaN equals itself)
        written = plan.hyper_rows.tobytes()
        if written != plan.written:
            plan.written = plan.inputs = None  # (until the copy below is queued)
            self._copy_hyper(plan.hyper_base)
            plan.written = written
        plan.inputs = inputs if all(map(_immutable_values, opt.param_groups)) else None

    def _copy_hyper(self, target):
        plan = self._plan
        with torch.no_grad():
            if plan.device.type == "cpu":
                target.copy_(plan.hyper_host)
            else:
                # From pageable memory: the runtime stages the values as the copy is issued
                # (cudaMemcpyAsync from pageable memory), so the next step may refill the host
                # array at once; the copy runs in stream order after the last update that read
                # the device array.
                target.copy_(plan.hyper_host, non_blocking=True)

    def device_update(self, opt, algorithm, records=(), scaled_by=0.0, loss_out=None,
                      ring=None):
        """The update's device work, with no host read: the step slot (Adam) or the first-step
        flag (SGD) from the device's counts, the reduce-update, the counts advanced where the
        records let the update apply (and, given a graphed step's ring, the records into it):
        three launches on a GPU (two for SGD without momentum). Returns the norm tensor it
        writes (max_grad_norm; else None). The host's values are hyper_base's (write_hyper)."""
        plan = self._plan
        op = opt._op
        # Adam's step counts, or whether each group's SGD momentum has begun (none without it)
        counts = plan.steps if op == "adam" else plan.started if plan.keys else None
        with torch.no_grad():
            if counts is not None:
                torch.ops.dpcuda.update_hyper_(plan.hyper, plan.hyper_base, counts,
                                               plan.first_index if op == "adam" else None, op)
                hyper = plan.completed_rows
            else:
                hyper = plan.base_rows  # (nothing to complete on the device: the host's rows)
            clip = opt.max_grad_norm
            norm = torch.empty(1, dtype=plan.buffers[0][0].dtype, device=plan.device) \
                if clip is not None else None
            # gather=False: the new weights land in replica 0's buffer only. The others take
            # them at the next forward, whose sync copies replica 0's weights to every replica
            # whatever happened in between (replicas.py), so writing them here too would move
            # the weights twice. max_grad_norm: the clipping inside the reduction.
            records = list(records)
            torch.ops.dpcuda.reduce_update_(*plan.buffers, *plan.lists, hyper, plan.segments,
                                            op, False, algorithm, False, clip, norm,
                                            records or None, scaled_by, loss_out)
            self.issued = True
            if norm is not None:
                opt.grad_norm = norm.reshape(())
            # The counts advanced where the update applied (the records say so on the device;
            # a skipped update counts no step and begins no momentum), and the ring's slot.
            if counts is not None or ring is not None:
                torch.ops.dpcuda.update_counts_(
                    records, counts, None if ring is None else ring.records,
                    None if ring is None else ring.counter, op)
        return norm

    def finish(self, opt):
        """What opt.step() leaves on the host once an update is issued: the weights' versions
        and Adam's step counts' (autograd sees them changed, as after torch.optim's in-place
        update), SGD's momentum buffers made at its first step (a zero buffer where the device
        skipped it, which the next update starts afresh, as the device's flag says)."""
        plan = self._plan
        torch.autograd.graph.increment_version(plan.versioned)
        if opt._op == "sgd" and plan.keys and self._first:
            for index in self._first:
                for i in plan.members[index]:
                    opt.state[plan.params[i]]["momentum_buffer"] = \
                        plan.views["momentum_buffer"][i]
            plan.see_state(opt)

    @property
    def _flat(self):  # (tests: the flat state buffers)
        return self._plan.flat if self._plan is not None else {}

    @property
    def _key(self):  # (tests: whether a plan was made)
        return self._plan_key if self._plan is not None else None
