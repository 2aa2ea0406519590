"""ZeRO-1 across processes: DataParallel.step(..., optimizer=opt) with reducer "dist" and a
dpcuda.optim optimizer.

The flat parameters are split into one shard per process (the two_shot split over processes).
After the local replicas' sum, one reduce-scatter gives each process the global sum of the
gradients of its own shard only; each process updates its shard's weights with its shard's
optimizer state (the only optimizer state it keeps: 1/W of the moments); one all-gather brings
every process the updated weights, so every process ends with the same bits. Between the two, a
small all-gather of each process's (non-finite flag, sum of squares) decides alike on every
process whether to skip the step and, with max_grad_norm, the global norm (the partial sums
added in rank order, in float64).

While the state is sharded, opt.state holds Adam's step counts only and opt.state_dict()
raises: opt.consolidate_state_dict(to=rank), called on every process, gathers the whole state
on that rank (to=None: on every rank), whose state_dict() is then torch's format until its next
step. opt.load_state_dict() loads a whole state on every process; the next step takes each
process's shard of it.

Collectives here pair with the same collectives on every other process: every process must
run the same steps with the same optimizer configuration (as DDP requires).
"""

import math

import torch

from .fused_update import _HYPER, group_of_trainable, group_segments, plan_key, shard_range


def _state_keys(opt, group):
    if opt._op == "sgd":
        return ("momentum_buffer",) if group["momentum"] != 0 else ()
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())


class _Shards:
    """One optimizer's sharded state over one replica set's flat layout, on one process."""

    def __init__(self, opt, r0, keys, group_of, dist, group, comm_device):
        self.opt, self.keys = opt, keys
        self.dist, self.group, self.comm = dist, group, comm_device
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.params = [r0.params[i] for i in r0.trainable]
        self.spans = list(r0.spans)
        self.n = n = r0.flat_param.numel()
        self.dtype, self.device = r0.flat_param.dtype, r0.device
        align = 16 // r0.flat_param.element_size()
        b0, e0 = shard_range(n, self.world, 0, align)
        self.per = max(e0 - b0, align)  # every process's slot in the padded buffers
        self.slot = slice(self.rank * self.per, (self.rank + 1) * self.per)  # this process's
        self.begin, self.end = shard_range(n, self.world, self.rank, align)
        self.flat = self.pad = self.grad = None  # (made by bind(): see _allocate)
        self.steps = torch.zeros(len(self.params), dtype=torch.float32)
        self.step_views = list(self.steps.unbind())
        self.started = [False] * len(opt.param_groups)  # SGD: a group's momentum has begun
        # The shard's parameter groups, for reduce_update_.
        self.segments = group_segments(self.spans, group_of, self.begin, self.end)
        self.members = [[i for i, g in enumerate(group_of) if g == index]
                        for index in range(len(opt.param_groups))]
        # bound: the shards hold the optimizer's state on every process (set by bind(), alike
        # everywhere; cleared by a load_state_dict, which every process makes): what decides
        # the collectives. sharded: this process's opt.state lacks the whole state (its
        # state_dict() raises); a consolidation on this rank clears it.
        self.bound = False
        self.sharded = False

    def _allocate(self):
        size = self.end - self.begin
        self.flat = {k: torch.zeros(size, dtype=self.dtype, device=self.device)
                     for k in self.keys}
        # The reduce-scatter's input and the all-gather's output: W slots of `per` elements,
        # the tail past n always zero.
        self.pad = torch.zeros(self.world * self.per, dtype=self.dtype, device=self.comm)
        self.grad = torch.zeros(self.per, dtype=self.dtype, device=self.comm)

    @property
    def state_bytes(self):
        """The optimizer state this process keeps (its shard of every state buffer)."""
        return sum(t.numel() * t.element_size() for t in (self.flat or {}).values())

    def _overlap(self, i):
        """Parameter i's part of the shard: (its slice, the shard's slice), or None."""
        o, c = self.spans[i]
        lo, hi = max(o, self.begin), min(o + c, self.end)
        if hi <= lo:
            return None
        return slice(lo - o, hi - o), slice(lo - self.begin, hi - self.begin)

    # -- the state between opt.state and the shards -----------------------------------------

    def current(self):
        """Whether this process's opt.state is the sharded view the shards hold (no
        load_state_dict, no consolidation on this rank, no assignment since bind)."""
        if not self.sharded:
            return False
        adam = self.opt._op == "adam"
        for i, p in enumerate(self.params):
            state = self.opt.state.get(p, {})
            if any(k in state for k in self.keys):
                return False
            if adam and state.get("step") is not self.step_views[i]:
                return False
        return True

    def whole_ok(self):
        """Before bind(): whether opt.state can be sharded: every state tensor it holds has its
        parameter's number of elements (else opt.step() on the whole state raises, as it
        should), and each group's parameters are at the same point (the same Adam step count;
        SGD momentum begun for all or none)."""
        opt = self.opt
        for p in self.params:
            state = opt.state.get(p, {})
            for k in self.keys:
                t = state.get(k)
                if t is not None and (not torch.is_tensor(t) or t.numel() != p.numel()):
                    return False
        for m in self.members:
            if opt._op == "adam":
                steps = {float(opt.state[self.params[i]]["step"])
                         if "step" in opt.state.get(self.params[i], {}) else 0.0 for i in m}
                if len(steps) > 1:
                    return False
            elif self.keys and len({"momentum_buffer" in opt.state.get(self.params[i], {})
                                    for i in m}) > 1:
                return False
        return True

    def uniform(self):
        """After bind(): Adam's step counts alike within each group (SGD's begun flag is per
        group by construction)."""
        if self.opt._op != "adam":
            return True
        steps = self.steps.tolist()
        return all(len({steps[i] for i in m}) <= 1 for m in self.members)

    def bind(self):
        """This process's shard of the optimizer's whole state (opt.state) into the shards;
        the whole tensors then dropped from opt.state (Adam's step counts become views of the
        shards' step counts). Entries opt.state lacks start at zero, as torch.optim's lazy
        state, except where the shards already hold the state (an entry assigned since
        replaces only itself)."""
        opt = self.opt
        adam = opt._op == "adam"
        if self.flat is None:
            self._allocate()
        with torch.no_grad():
            for index, m in enumerate(self.members):
                if self.keys and not adam and m:
                    self.started[index] = "momentum_buffer" in opt.state.get(self.params[m[0]],
                                                                            {})
            for i, p in enumerate(self.params):
                if not adam and not self.keys:
                    continue  # (SGD without momentum: a buffer left from before stays whole)
                state = opt.state[p]
                where = self._overlap(i)
                for k in self.keys:
                    have = state.pop(k, None)
                    if where is None:
                        continue
                    mine, shard = where
                    if have is not None:
                        self.flat[k][shard].copy_(have.detach().reshape(-1)[mine])
                    elif not self.sharded:
                        self.flat[k][shard].zero_()
                if adam:
                    have = state.get("step")
                    view = self.step_views[i]
                    if have is not view:
                        view.fill_(0.0 if have is None else float(have))
                        state["step"] = view
                elif not state:
                    del opt.state[p]  # (as torch.optim: no entry before the first update)
        self.bound = self.sharded = bool(self.keys)

    def unshard(self, keep=True):
        """Gathers the whole state from every process (a collective: every process calls it
        at the same point, with bound set alike). keep: this process puts it into opt.state
        (torch's format: whole tensors shaped as the parameters); otherwise it only takes
        part. A process whose opt.state holds whole entries newer than its shard (a
        consolidation on it, then a step of its own) sends those."""
        opt = self.opt
        if not self.current():
            self.bind()
        adam = opt._op == "adam"
        size = self.end - self.begin
        gathered = {}
        for k in self.keys:
            whole = torch.zeros(self.world * self.per, dtype=self.dtype, device=self.comm)
            whole[self.slot][:size].copy_(self.flat[k])
            self.dist.all_gather_into_tensor(whole, whole[self.slot], group=self.group)
            gathered[k] = whole[:self.n].to(self.device)
        if not keep:
            return
        with torch.no_grad():
            for index, m in enumerate(self.members):
                for i in m:
                    p = self.params[i]
                    o, c = self.spans[i]
                    for k in self.keys:
                        if k == "momentum_buffer" and not self.started[index]:
                            continue
                        opt.state[p][k] = gathered[k][o:o + c].view_as(p)
                    if adam:
                        opt.state[p]["step"] = self.step_views[i].clone()
        self.sharded = False

    # -- the step -----------------------------------------------------------------------------

    def exchange(self, flat_grad, record):
        """The step's first collectives, in flight together: the record's all-reduce and the
        reduce-scatter of the gradients (this process then holds its shard's global sum in
        self.grad). flat_grad None: a failed step's part, with zero gradients."""
        if flat_grad is None:
            self.pad.zero_()
        else:
            self.pad[:self.n].copy_(flat_grad)
        works = [self.dist.all_reduce(record, group=self.group, async_op=True),
                 self.dist.reduce_scatter_tensor(self.grad, self.pad, group=self.group,
                                                 async_op=True)]
        for w in works:
            w.wait()

    def verdict(self, scale, clip):
        """After exchange(): the shard's gradient scaled by `scale` (1: untouched), then one
        all-gather of every process's (non-finite, sum of squares). Returns (skip, norm): skip
        when any process's shard holds a NaN or an Inf; norm (clip given) the global 2-norm,
        the shards' float64 sums of squares added in rank order, in the gradients' dtype."""
        own = self.grad[:self.end - self.begin]
        if scale != 1.0:
            own.mul_(scale)
        stats = torch.zeros(2, dtype=torch.float64, device=self.comm)
        if own.numel():
            stats[0] = (~torch.isfinite(own)).any().double()
            if clip is not None:
                wide = own.double()
                stats[1] = torch.dot(wide, wide)
        every = torch.empty(2 * self.world, dtype=torch.float64, device=self.comm)
        self.dist.all_gather_into_tensor(every, stats, group=self.group)
        values = every.tolist()
        if any(values[0::2]):
            return True, None
        if clip is None:
            return False, None
        total = 0.0
        for v in values[1::2]:
            total += v
        return False, torch.tensor(math.sqrt(total), dtype=self.dtype, device=self.device)

    def update(self, norm, r0_flat):
        """The owner's update of its shard (the gradient clipped by norm first, as
        clip_grad_norm_ scales it), then the all-gather of the weights into r0_flat. Runs
        inside opt.step(), as FusedUpdate.update does."""
        opt = self.opt
        adam = opt._op == "adam"
        size = self.end - self.begin
        own = self.grad[:size]
        if own.device != self.device:
            own = own.to(self.device)
        if norm is not None:
            # torch.nn.utils.clip_grad_norm_'s coefficient and its in-place scaling
            coef = torch.clamp(opt.max_grad_norm / (norm + 1e-6), max=1.0)
            own.mul_(coef)
        steps = self.steps.tolist() if adam else None
        if size:
            hyper = []
            for index, group in enumerate(opt.param_groups):
                m = self.members[index]
                if not m:
                    hyper.append(torch.zeros(_HYPER, dtype=torch.float64, device=self.device))
                    continue
                if adam:
                    key = steps[m[0]] + 1
                else:
                    key = not self.started[index]
                hyper.append(opt._hyper_tensor(index, self.device, opt._values(group, key)))
            lists = [[self.flat[k]] for k in self.keys]
            lists += [[] for _ in range(3 - len(lists))]
            weights = r0_flat[self.begin:self.end]
            torch.ops.dpcuda.reduce_update_([weights], [own], *lists, hyper, self.segments,
                                            opt._op, False, "one_shot", False, None, None)
        self.pad[self.slot][:size].copy_(r0_flat[self.begin:self.end])
        self.dist.all_gather_into_tensor(self.pad, self.pad[self.slot], group=self.group)
        r0_flat.copy_(self.pad[:self.n])
        torch.autograd.graph.increment_version(self.params)
        # What opt.step() leaves in the state once the update has happened.
        if adam:
            self.steps.add_(1)
        elif self.keys:
            self.started = [True] * len(self.started)


class ShardedUpdate:
    """The ZeRO-1 update of one dpcuda.optim optimizer across processes: decide() agrees with
    the other processes whether a step takes this path (and re-shards or gathers the state as
    needed); the DataParallel step then drives exchange, verdict and update."""

    def __init__(self):
        self.shards = None
        self._key = None

    def release(self):
        """Gives the state this wrapper holds sharded back to its optimizer, whole (a
        collective where it is sharded: bound is alike on every process)."""
        shards, self.shards, self._key = self.shards, None, None
        if shards is None:
            return
        if shards.bound:
            shards.unshard(keep=True)
            shards.bound = False
        if shards.opt.__dict__.get("_shards") is shards:
            del shards.opt.__dict__["_shards"]

    def _candidate(self, opt, replicas, generation, dist, group, comm_device):
        """The shards this step would use and their key, or None where the sharded path does
        not apply on this process: a dpcuda.optim optimizer without step pre-hooks over exactly
        the trainable parameters, one kind of state in every group, each group's parameters at
        the same point, state tensors that fit. Looks only, changes nothing."""
        from torch.optim.optimizer import _global_optimizer_pre_hooks

        from ..optim import _FusedOptimizer
        if not isinstance(opt, _FusedOptimizer) or opt._optimizer_step_pre_hooks or \
                _global_optimizer_pre_hooks:
            return None
        groups = opt.param_groups
        structure = {_state_keys(opt, g) for g in groups}
        if len(structure) != 1:
            return None
        key = plan_key(opt, generation, structure.pop())
        shards = self.shards
        if key != self._key or shards is None or opt.__dict__.get("_shards") is not shards:
            group_of = group_of_trainable(opt, replicas[0])
            if group_of is None:
                return None
            shards = _Shards(opt, replicas[0], key[2], group_of, dist, group, comm_device)
        ok = shards.uniform() if shards.current() else shards.whole_ok()
        return (shards, key) if ok else None

    def decide(self, opt, replicas, generation, dist, group, comm_device, want=True):
        """Whether this step's update is the sharded one, agreed by every process (one small
        all-reduce: a choice made from one process's own data, hooks or state would leave the
        processes in different collectives). Every process calls it at the same point of the
        same step. Sharded: the state is bound (a previous owner's gathered first); whole: a
        state this wrapper held sharded is gathered back into the optimizer."""
        found = self._candidate(opt, replicas, generation, dist, group, comm_device) \
            if want else None
        flag = torch.tensor([0.0 if found is None else 1.0], dtype=torch.float64,
                            device=comm_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        if flag.item() == 0.0:
            self.release()
            return False
        shards, key = found
        if shards is not self.shards:
            self.release()
            other = opt.__dict__.get("_shards")
            if other is not None and other.bound:
                # (another DataParallel sharded this optimizer: its shards hold the state)
                other.unshard(keep=True)
                other.bound = False
            self.shards, self._key = shards, key
            opt._shards = shards
        if not shards.current():
            shards.bind()
        return True
