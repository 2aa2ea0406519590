"""The one-call step's update by a dpcuda.optim optimizer, fused into the replicas' reduction
(torch.ops.dpcuda.reduce_update_): each replica reduces the shard of the gradients it owns
(the two_shot split), updates that shard's weights with that shard's optimizer state, and the
weights are gathered to every replica. The optimizer state is sharded (ZeRO-1): replica k keeps
the state of shard k only.

Here every replica shares one device (the CPU, or one GPU), so the shards are slices of one
flat buffer per state tensor (exp_avg, ...) laid out as the replicas' flat parameters, and the
optimizer's own state entries (opt.state[p]["exp_avg"], ...) are views of it: its state_dict()
is torch's format and always current, and load_state_dict() is followed at the next step.
"""

import torch

# The state tensors of each optimizer family, in the kernels' state1..3 order.
_KEYS = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}


def shard_range(n, replicas, k, align):
    """csrc/cpu/all_reduce.h's shard_range: replica k's two_shot shard [begin, end)."""
    per = -(-n // replicas)
    per = -(-per // align) * align
    begin = min(per * k, n)
    return begin, min(per * k + per, n)


class FusedUpdate:
    """The flat, sharded state of one dpcuda.optim optimizer over one replica set, and its
    fused update. ready() says whether a step can take this path; update() runs it."""

    def __init__(self):
        self._key = None      # (optimizer id, replica generation, state keys)
        self._flat = {}       # state key -> the flat buffer
        self._views = {}      # state key -> [view per trainable parameter]

    def ready(self, opt, replicas, unused):
        """Whether the fused update applies: a dpcuda.optim optimizer over every trainable
        parameter (one group each, the same kind of state in every group), every replica on
        one device, every parameter with a gradient, and each group's parameters at the same
        step. Otherwise the step reduces and then calls opt.step() (as exact, slower)."""
        from ..optim import _FusedOptimizer
        if not isinstance(opt, _FusedOptimizer) or unused:
            return False
        from torch.optim.optimizer import _global_optimizer_pre_hooks
        if opt._optimizer_step_pre_hooks or _global_optimizer_pre_hooks:
            return False  # (a pre-hook may read or change .grad: it gets the global gradient)
        if len({r.device for r in replicas}) != 1:
            return False  # (shards on several devices: not yet; see the module docstring)
        r0 = replicas[0]
        params = [r0.params[i] for i in r0.trainable]
        group_of = {}
        for g, group in enumerate(opt.param_groups):
            for p in group["params"]:
                group_of[id(p)] = g
        if len(group_of) != len(params) or any(id(p) not in group_of for p in params):
            return False
        structure = {self._structure(opt, group) for group in opt.param_groups}
        if len(structure) != 1:
            return False
        self._group_of = [group_of[id(p)] for p in params]
        self._params = params
        return all(len({self._step_key(opt, p) for p, g in zip(params, self._group_of)
                        if g == index}) <= 1 for index in range(len(opt.param_groups)))

    @staticmethod
    def _structure(opt, group):
        if opt._op == "sgd":
            return ("momentum_buffer",) if group["momentum"] != 0 else ()
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    @staticmethod
    def _step_key(opt, p):
        state = opt.state.get(p, {})
        if opt._op == "sgd":
            return "momentum_buffer" not in state
        step = state.get("step")
        return 0.0 if step is None else float(step)

    def _bind(self, opt, replicas, keys, generation):
        """The flat buffers and the optimizer's state entries as their views: values the
        optimizer already holds (a loaded state_dict, earlier steps) are copied in."""
        r0 = replicas[0]
        key = (id(opt), generation, keys)
        fresh = key != self._key
        if fresh:
            n = r0.flat_param.numel()
            self._flat = {k: torch.zeros(n, dtype=r0.flat_param.dtype, device=r0.device)
                          for k in keys}
            self._views = {k: [self._flat[k][o:o + c].view_as(p)
                               for (o, c), p in zip(r0.spans, self._params)] for k in keys}
            self._key = key
        with torch.no_grad():
            for k in keys:
                for p, view in zip(self._params, self._views[k]):
                    have = opt.state[p].get(k)
                    if have is None:
                        view.zero_()  # (torch.optim's lazy state starts at zero)
                    elif have.data_ptr() != view.data_ptr() or have.shape != view.shape:
                        view.copy_(have)
                        opt.state[p][k] = view

    def update(self, opt, replicas, generation, algorithm):
        """The fused reduce-update of the replicas' gradients (flat_grad) into every replica's
        weights; the optimizer's state and step counts advanced as its step() would."""
        r0 = replicas[0]
        groups = opt.param_groups
        keys = self._structure(opt, groups[0])
        self._bind(opt, replicas, keys, generation)
        n = r0.flat_param.numel()
        R = len(replicas)
        align = 16 // r0.flat_param.element_size()
        bounds = [shard_range(n, R, k, align) for k in range(R)]
        shards = [[self._flat[k][b:e] for b, e in bounds] for k in keys]
        # The kernels' state1..3: SGD's momentum buffer; Adam's exp_avg, exp_avg_sq and, with
        # amsgrad, max_exp_avg_sq.
        lists = [shards[0] if len(shards) > 0 else [], shards[1] if len(shards) > 1 else [],
                 shards[2] if len(shards) > 2 else []]
        hyper = []
        for index, group in enumerate(groups):
            members = [p for p, g in zip(self._params, self._group_of) if g == index]
            if not members:
                hyper += [torch.zeros(16, dtype=torch.float64, device=r0.device)] * R
                continue
            step_key = self._step_key(opt, members[0])
            values = opt._values(group, step_key + 1 if opt._op == "adam" else step_key)
            hyper += [opt._hyper_tensor(index, r0.device, values)] * R
        segments = []
        for (o, c), g in zip(r0.spans, self._group_of):
            if segments and segments[-1][2] == g and segments[-1][1] == o:
                segments[-1][1] = o + c
            else:
                segments.append([o, o + c, g])
        flat_segments = [v for s in segments for v in s]

        def run():
            torch.ops.dpcuda.reduce_update_([r.flat_param for r in replicas],
                                            [r.flat_grad for r in replicas], *lists, hyper,
                                            flat_segments, opt._op, False, algorithm)
            self._commit(opt, keys)
        # Through opt.step(), so that what wraps it runs as for any step: its post-hooks, the
        # learning-rate schedulers' bookkeeping, the profiler's record.
        for r in replicas:
            r.drop_grads()
        opt._fused_step = run
        try:
            opt.step()
        finally:
            opt.__dict__.pop("_fused_step", None)

    def _commit(self, opt, keys):
        """What opt.step() leaves in the state once the update has happened: SGD's momentum
        buffers (made at the first step), Adam's step counts."""
        if opt._op == "sgd":
            if keys:
                for p, view in zip(self._params, self._views[keys[0]]):
                    opt.state[p]["momentum_buffer"] = view
        else:
            steps = []
            for i, p in enumerate(self._params):
                state = opt.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                for k in keys:
                    state[k] = self._views[k][i]
                steps.append(state["step"])
            torch._foreach_add_(steps, 1)
