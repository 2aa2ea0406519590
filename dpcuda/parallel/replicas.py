"""The replicas of a wrapped model, kept at the model's state.

Replica 0 is the model itself: it is trained in place. Replica i >= 1 holds tensors of its own
on devices[i] (parameters and buffers) and, for each forward, a module tree that is a shallow
replica of the model's (torch's Module._replicate_for_data_parallel, as nn.DataParallel makes
them) pointing at those tensors. So whatever the model's modules are at that moment (training
mode, hooks, attributes, submodules replaced after wrapping) is what every replica runs.

Before each forward, ReplicaSet.sync() brings the replicas' tensors to the model's:
- a new, removed or replaced parameter or buffer, a changed requires_grad, or a parameter
  whose .data was replaced rebuilds the replicas' tensors;
- the weights are copied, with one flat copy per replica for the trainable ones (the model's
  trainable parameters are views of one flat buffer), and the buffers (DDP's
  broadcast_buffers: replica 0's win). Every forward: version counters would miss changes
  that make no version bump (torch's fused optimizers, writes through .data, batch norm's
  statistics).
A replica whose own parameters changed outside dpcuda raises: its weights could no longer be
the model's.
"""

import types

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .. import _C
from ..nn import FusedLinear, _has_grad_hooks, _has_hooks


class ReplicaError(RuntimeError):
    """A replica can no longer be kept at the model's state."""


def _refuse(name, m, replicas):
    """A module whose result on k >= 2 replicas cannot equal one device's: a clear error."""
    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
        kind = type(m).__name__
        if m.sparse:
            raise ValueError(f"dpcuda DataParallel: {name or 'the model'} is an "
                             f"nn.{kind}(sparse=True); sparse gradients cannot be reduced "
                             f"into the flat gradient buffers (use sparse=False)")
        if replicas > 1 and m.max_norm is not None:
            raise ValueError(f"dpcuda DataParallel: {name or 'the model'} is an "
                             f"nn.{kind}(max_norm={m.max_norm}); its forward renormalises "
                             f"the rows each replica sees, in place, so the replicas' weights "
                             f"would differ (use max_norm=None, or one replica)")


def _refuse_hook(name, replicas):
    raise ValueError(
        f"dpcuda DataParallel: parameter {name!r} has a gradient hook (register_hook or "
        f"register_post_accumulate_grad_hook); with {replicas} replicas it would see replica "
        f"0's share of the gradient, not the one-device gradient. Remove it, or read the "
        f"gradient after backward() (it is then the global one)")


class Replica:
    """One replica's tensors on its device.

    params, buffers: one per model parameter and buffer (model order); replica 0's are the
    model's own. The trainable parameters are views of flat_param, their gradients views of
    flat_grad; flat_grad is the head of `exchange`, which has `record` more elements behind it
    (room for what the reducer "dist" sends with the gradients). momentum: the convenience
    step's SGD momentum (flat), or None."""

    def __init__(self, params, buffers, device, copy, record=0):
        self.device = device
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise TypeError(f"every parameter must have one floating dtype, got "
                            f"{sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else torch.float32
        if not dtype.is_floating_point:
            raise TypeError(f"parameters must be floating point, got {dtype}")
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        self.frozen = [i for i, p in enumerate(params) if not p.requires_grad]
        total = sum(params[i].numel() for i in trainable)
        self.flat_param = torch.empty(total, dtype=dtype, device=device)
        self.exchange = torch.zeros(total + record, dtype=dtype, device=device)
        self.flat_grad = self.exchange[:total]
        self.momentum = None
        self.trainable = trainable
        self.spans = []  # each trainable parameter's (offset, numel) in the flat buffers
        self.params, self.buffers = [], []
        offset = 0
        views = {}
        for i in trainable:
            n = params[i].numel()
            self.flat_param[offset:offset + n].copy_(params[i].detach().reshape(-1))
            views[i] = self.flat_param[offset:offset + n].view_as(params[i])
            self.spans.append((offset, n))
            offset += n
        for i, p in enumerate(params):
            if not copy:  # the model's own parameter, its data now a view of the flat buffer
                if i in views:
                    grad = p.grad
                    p.data = views[i]
                    if grad is not None:
                        p.grad = grad
                self.params.append(p)
            elif i in views:
                # A version counter of its own (not the flat buffer's): an in-place change of
                # this parameter is seen, dpcuda's writes to the flat buffer are not.
                q = nn.Parameter(torch.empty(0, dtype=dtype, device=device))
                q.data = views[i]
                self.params.append(q)
            else:
                self.params.append(nn.Parameter(p.detach().to(device, copy=True),
                                                requires_grad=False))
        for b in buffers:
            self.buffers.append(b if not copy or b is None else b.detach().to(device, copy=True))
        self.views = [self.flat_grad[o:o + n].view_as(self.params[i])
                      for i, (o, n) in zip(trainable, self.spans)]
        # step_status's workspace (CUDA: int32 zeros, left zero by every launch)
        ints = _C._step_status_ints() if torch.device(device).type == "cuda" else 0
        self.status_work = torch.zeros(ints, dtype=torch.int32, device=device)
        self.module = None  # the module tree of the last forward
        self.tree = None    # its modules' parameter dicts, with the ids they held
        self.maps = None    # replica 0's tensors (by id) to this replica's
        self.memo = None    # (model module, its replica) pairs of the tree
        self.memo_key = None  # the model structure they were made for
        self._acc = None    # accumulators()
        self.fused = []     # its FusedLinear layers whose backward may write into flat_grad
        self.unused = set()  # the trainable parameters the last backward gave no gradient

    def accumulators(self):
        """The AccumulateGrad nodes of the trainable parameters (kept: hooks on them stay)."""
        if self._acc is None:
            self._acc = [accumulator(self.params[i]) for i in self.trainable]
        return self._acc

    def __getstate__(self):  # (copy.deepcopy, pickle: no autograd nodes; made again lazily)
        state = dict(self.__dict__)
        state["_acc"] = None
        return state

    def ensure_momentum(self):
        if self.momentum is None:
            self.momentum = torch.zeros_like(self.flat_param)

    def set_module(self, module):
        """The model's own tree (replica 0); finds the fused layers whose backward can write
        their gradients straight into flat_grad (not a parameter two layers share, whose two
        gradients would be written to one place)."""
        self.module = module
        slot = {id(self.params[i]): k for k, i in enumerate(self.trainable)}
        layers = [m for m in module.modules() if isinstance(m, FusedLinear)]
        own = [(m._parameters.get("weight"), m._parameters.get("bias")) for m in layers]
        uses = {}
        for pair in own:
            for q in pair:
                if q is not None:
                    uses[id(q)] = uses.get(id(q), 0) + 1

        def into(q):
            if q is None or id(q) not in slot or uses[id(q)] != 1:
                return None
            return slot[id(q)]
        self.fused = [(m, tuple(into(q) for q in pair), pair) for m, pair in zip(layers, own)]

    def release_grads(self, into=True):
        """Before the convenience step's forward: .grad None (autograd then takes the fused
        layers' gradients, which are views of the buffer, as they are) and each fused layer
        told where its backward writes. into=False (a later micro-batch, whose gradients add to
        the buffer, after collect_grads, which left no layer writing into it): .grad only."""
        for i in self.trainable:
            self.params[i].grad = None
        if not into:
            return
        for m, slots, pair in self.fused:
            # Not for a parameter with gradient hooks: they would be handed the buffer itself,
            # which the next step overwrites, where torch hands them a tensor of their own.
            into = tuple(self.views[s] if s is not None and not q._backward_hooks else None
                         for s, q in zip(slots, pair))
            # (straight into __dict__: nn.Module.__setattr__ costs microseconds a call)
            m.__dict__["_grads_into"] = into if any(t is not None for t in into) else None

    def collect_grads(self, add=False):
        """After the backward (or a failure): every gradient in the buffer and .grad the
        buffer's view again. A fused layer's gradient is there already; any other is copied in;
        a parameter that got none (unused by this forward, or a replica without rows) is 0.
        add (after a later micro-batch, released with into=False): this backward's gradients
        are added to what the buffer holds, in micro-batch order; a parameter is unused when
        no micro-batch used it."""
        for m, _, _ in self.fused:
            m.__dict__["_grads_into"] = None
        unused = set()
        for k, i in enumerate(self.trainable):
            p, view = self.params[i], self.views[k]
            g = p.grad
            if g is None:
                unused.add(k)
                if not add:
                    view.zero_()
            elif add:
                view.add_(g)
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
            p.grad = view
        self.unused = unused & self.unused if add else unused

    def drop_grads(self):
        for i in self.trainable:
            self.params[i].grad = None


def accumulator(t):
    """The AccumulateGrad node of leaf t (the caller keeps it alive, so it stays t's)."""
    with torch.enable_grad(), torch.inference_mode(False):
        return t.view_as(t).grad_fn.next_functions[0][0]


# torch's own Module attributes, and the types of plain settings: skipped by the check below.
_MODULE_ATTRIBUTES = frozenset(vars(nn.Module()))
_PLAIN_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.Size)


def _check_attributes(m):
    """A module attribute outside _parameters/_buffers/_modules that points at modules (a
    plain list of layers, a bound method such as a patched forward) would make a replica run
    the model's own modules: refused."""
    for k, v in m.__dict__.items():
        if k in _MODULE_ATTRIBUTES or type(v) in _PLAIN_TYPES:
            continue
        if isinstance(v, types.MethodType) and isinstance(v.__self__, nn.Module):
            what = "a method bound to a module"
        elif isinstance(v, nn.Module):
            what = "a module outside its submodules"
        elif isinstance(v, (list, tuple)) and any(isinstance(x, nn.Module) for x in v):
            what = "a plain list or tuple of modules (use nn.ModuleList)"
        elif isinstance(v, dict) and any(isinstance(x, nn.Module) for x in v.values()):
            what = "a plain dict of modules (use nn.ModuleDict)"
        else:
            continue
        raise ValueError(f"dpcuda DataParallel: attribute {k!r} of a {type(m).__name__} holds "
                         f"{what}; every replica would run the model's own modules with it")


def _replicate_tree(model, pmap, bmap):
    """A shallow replica of model's module tree (what Module._replicate_for_data_parallel
    makes, as nn.DataParallel does each forward) whose parameters and buffers are pmap's and
    bmap's (keyed by the model tensor's id). Returns the root and memo: the replica of each
    model module, by the module's id."""
    memo = {}

    def rep(m):
        r = memo.get(id(m))
        if r is not None:
            return r
        r = object.__new__(type(m))
        memo[id(m)] = r
        _check_attributes(m)
        d = m.__dict__.copy()
        d["_parameters"] = {k: None if p is None else pmap[id(p)]
                            for k, p in m._parameters.items()}
        d["_buffers"] = {k: None if b is None else bmap[id(b)] for k, b in m._buffers.items()}
        d["_modules"] = {k: None if c is None else rep(c) for k, c in m._modules.items()}
        d["_is_replica"] = True
        r.__dict__ = d
        return r
    return rep(model), memo


# The attribute values a graphed step's key holds as they are (walk()).
_VALUES = (bool, int, float, str, type(None), torch.Size, torch.device, torch.dtype)


def _strides(t):
    """A parameter's or buffer's strides as the structure's key holds them (None: a layout
    without strides). A tensor given other strides over the same storage (p.data =
    p.data.t(), as_strided) is another structure: the replicas' flat views are built again."""
    return t.stride() if t.layout == torch.strided else None


def _attribute_key(v, objects):
    """A module attribute as a graph's key holds it: a plain value (a tuple of them) as it is
    (NaN as "nan", which equals itself); a tensor by its storage, dtype and shape; any other
    object by its identity, the object kept in objects (the graph keeps them alive, so that a
    freed object's id, given to a new one, cannot stand for it)."""
    t = type(v)
    if t in _VALUES:
        return "nan" if t is float and v != v else v
    if t is tuple and all(type(e) in _VALUES for e in v):
        return tuple("nan" if type(e) is float and e != e else e for e in v)
    if isinstance(v, torch.Tensor):
        try:
            return (v.data_ptr(), v.dtype, tuple(v.shape))
        except RuntimeError:  # (no storage: a sparse or meta tensor, held as an object)
            pass
    objects.append(v)
    return id(v)


# ReplicaSet.walk in C (csrc/torch/model_walk.cpp); False: the Python walk alone (the tests
# compare the two).
_C._walk_setup(nn.Parameter, torch.Tensor, (nn.Embedding, nn.EmbeddingBag), _VALUES)
_C_WALK = True


class ReplicaSet:
    """The replicas of model on devices (devices[0] is the model's)."""

    def __init__(self, model, devices, record=0, before_build=None):
        self.model = model
        self._before_build = before_build
        self._pointers = None
        self._module_key = None
        self.on_accumulate = None  # called before a replica >= 1 accumulates a gradient
        self.generation = 0  # how many times the replicas were built
        # SGD momentum of parameters that are frozen now, kept for when they train again (as
        # torch.optim.SGD keeps its state while a parameter has no gradient).
        self._parked = WeakIdKeyDictionary()
        self.devices = devices
        self.record = record
        self.replicas = []
        self._structure = None
        self.sync()

    def __getstate__(self):  # (pickle: the parked momenta as pairs)
        state = dict(self.__dict__)
        state["_parked"] = list(self._parked.items())
        return state

    def __setstate__(self, state):
        parked = state.pop("_parked")
        self.__dict__.update(state)
        self._parked = WeakIdKeyDictionary()
        for k, v in parked:
            self._parked[k] = v

    def walk(self, graphed=True):
        """_walk_python's result, made in C (dpcuda._C._walk: the same objects, a few times
        faster) where the model has nothing the Python walk must refuse or see to itself."""
        if _C_WALK:
            found = _C._walk(self.model, graphed, len(self.devices))
            if found is not None:
                return found
        return self._walk_python(graphed)

    def _walk_python(self, graphed=True):
        """The model's parameters and buffers (in model.parameters() and model.buffers()
        order) and the key of its structure, in one walk over its modules (preorder, as
        named_modules walks them), which also refuses what cannot be made exact; with what a
        graphed step checks at every step, in the same pass (graphed=False: not read, (False,
        (), []) returned). Returns (params, buffers, key, (hooked, state, objects)). hooked:
        whether a module of the model has a forward or backward hook or a parameter a gradient
        hook. state: what a captured graph holds as it was at the capture, in the walk's
        order: every module's public attributes (_attribute_key: its training flag, a dropout's
        p, a slope or an eps by value, a tensor by its storage, any other object, a forward set
        on the instance among them, by identity, kept in objects) and every buffer's storage.
        An object changed in place (a dict, a config object) is not seen: the graph replays
        what it captured."""
        params, buffers, key, seen = [], [], [], set()
        hooked, state, objects = False, [], []
        replicas = len(self.devices)
        stack = [self.model]
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            key += (id(m), type(m))
            if graphed:
                state += [_attribute_key(v, objects) for k, v in m.__dict__.items()
                          if k[:1] != "_"]
            hooked = hooked or graphed and _has_hooks(m)
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                _refuse(self._module_name(m), m, replicas)
            for p in m._parameters.values():
                if p is not None and id(p) not in seen:
                    if type(p) is not nn.Parameter and not isinstance(p, nn.Parameter):
                        raise ValueError(
                            f"dpcuda DataParallel: the model's {self._param_names_of(m, p)} is "
                            f"a plain tensor, not an nn.Parameter (torch.func.functional_call "
                            f"on the wrapper?); call functional_call on dp.module, or register "
                            f"it as an nn.Parameter")
                    seen.add(id(p))
                    params.append(p)
                    key += (id(p), p.shape, _strides(p), p.requires_grad)
                    grad_hooked = _has_grad_hooks(p)
                    hooked = hooked or graphed and grad_hooked
                    if replicas > 1 and grad_hooked:
                        _refuse_hook(self._param_names()[id(p)], replicas)
            for b in m._buffers.values():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    buffers.append(b)
                    key += (id(b), b.shape, _strides(b))
                    if graphed:
                        state.append(b.data_ptr())
            children = [c for c in m._modules.values() if c is not None]
            stack.extend(reversed(children))
        # (a new dtype or device is new storage: sync() compares the data pointers too)
        key = tuple(key)
        return params, buffers, key, (hooked, tuple(state), objects)

    def sync(self, walk=None):
        """Brings every replica to the model's state (module docstring). Returns the replicas.
        Runs outside inference mode (the buffers it makes and the versions it reads must be
        those of normal tensors), whatever the caller's mode. walk: the model's walk (walk())
        if the caller made one since any other code could change the model; else walked
        here."""
        with torch.inference_mode(False), torch.no_grad():
            return self._sync(walk)

    def _sync(self, walk=None):
        params, buffers, key, _ = walk or self.walk(False)
        r0 = self.replicas[0] if self.replicas else None
        if key != self._structure or [p.data_ptr() for p in params] != self._pointers:
            self._build(params, buffers, key)
            return self.replicas
        if len(self.replicas) == 1:
            return self.replicas
        for r in self.replicas[1:]:
            if r.tree is not None and any([id(v) for v in d.values()] != ids
                                          for d, ids in r.tree):
                raise ReplicaError(
                    f"dpcuda DataParallel: the parameters of the replica on {r.device} were "
                    f"changed (added, removed or replaced on the replica, not on the model); "
                    f"make the change on dp.module, which every replica follows")
            for i, (p, v) in enumerate(zip(r.params, self._replica_versions[id(r)])):
                if p._version != v:
                    name = self._param_names().get(id(params[i]), f"parameter {i}")
                    raise ReplicaError(
                        f"dpcuda DataParallel: the replica on {r.device} changed its {name} in "
                        f"place (outside dpcuda), so it no longer holds the model's weights")
        # Every forward copies the weights and buffers: version counters would miss what
        # changes them with no version bump (torch's fused optimizers, writes through .data,
        # batch norm's statistics), and a missed change is a silently wrong model.
        for r in self.replicas[1:]:
            r.flat_param.copy_(r0.flat_param, non_blocking=True)
            for i in r.frozen:
                r.params[i].copy_(params[i], non_blocking=True)
            for b, rb in zip(buffers, r.buffers):
                rb.copy_(b, non_blocking=True)
        self._record_versions(params, buffers)
        return self.replicas

    def _param_names_of(self, module, tensor):
        prefix = self._module_name(module)
        key = next(k for k, v in module._parameters.items() if v is tensor)
        return f"{prefix}.{key}" if prefix else key

    def _module_name(self, module):
        return next(name for name, m in self.model.named_modules() if m is module)

    def _param_names(self):
        return {id(p): name for name, p in self.model.named_parameters()}

    def _build(self, params, buffers, key):
        device = self.devices[0]
        for t in params + buffers:
            if t.device != device:
                raise ValueError(
                    f"dpcuda DataParallel: the model has a tensor on {t.device}; the model is "
                    f"replica 0 and stays on devices[0] ({device}): move it back with "
                    f"dp.module.to({str(device)!r}), or wrap it anew for other devices")
        if self.replicas and self._before_build is not None:
            self._before_build()
        old = self.replicas
        old_momentum = None
        if old and old[0].momentum is not None:
            for i, (o, n) in zip(old[0].trainable, old[0].spans):
                self._parked[old[0].params[i]] = old[0].momentum[o:o + n].clone()
            old_momentum = True
        self.replicas = [Replica(params, buffers, self.devices[0], False, self.record)]
        self.replicas += [Replica(params, buffers, d, True, self.record)
                          for d in self.devices[1:]]
        if old_momentum is not None:
            # The SGD momentum of every parameter that trains carries over (also one frozen for
            # a while); one that never trained starts with none (zeros), as torch.optim.SGD's
            # lazy state.
            for r in self.replicas:
                r.ensure_momentum()
                for i, (o, n) in zip(r.trainable, r.spans):
                    m = self._parked.get(params[i])
                    if m is not None and m.numel() == n:
                        r.momentum[o:o + n].copy_(m.reshape(-1))
            for i in self.replicas[0].trainable:
                self._parked.pop(params[i], None)
        # (walked again: the trainable parameters are now views of the flat weights, with
        # strides of their own)
        self._structure = self.walk(False)[2]
        self.generation += 1
        self._pointers = [p.data_ptr() for p in params]
        self._record_versions(params, buffers)

    def _record_versions(self, params, buffers):
        self._replica_versions = {
            id(r): [p._version for p in r.params] for r in self.replicas[1:]}

    def build_modules(self):
        """This forward's module trees: the model for replica 0, shallow replicas for the
        others. Call after sync()."""
        r0 = self.replicas[0]
        if r0.module is not self.model or self._module_key != self._structure:
            r0.set_module(self.model)
            self._module_key = self._structure
        for r in self.replicas[1:]:
            if r._acc is None and self.on_accumulate is not None:
                # A backward that reaches this replica's parameters starts the reduction, also
                # one that did not come through dp's output.
                start = self.on_accumulate
                for node in r.accumulators():
                    node.register_prehook(lambda grads, start=start: start())
            if r.memo is not None and r.memo_key == self._structure:
                # The same modules, parameters and buffers: each replica module takes its
                # model module's attributes again (training mode, hooks, settings).
                for m, rm in r.memo:
                    _check_attributes(m)
                    d = m.__dict__.copy()
                    own = rm.__dict__
                    d["_parameters"], d["_buffers"] = own["_parameters"], own["_buffers"]
                    d["_modules"], d["_is_replica"] = own["_modules"], True
                    rm.__dict__ = d
                continue
            if r.maps is None:
                r.maps = ({id(p): q for p, q in zip(r0.params, r.params)},
                          {id(b): q for b, q in zip(r0.buffers, r.buffers)})
            r.module, memo = _replicate_tree(self.model, *r.maps)
            modules = {id(m): m for m in self.model.modules()}
            r.memo = [(modules[k], rm) for k, rm in memo.items()]
            r.memo_key = self._structure
            # Its fused layers: replica 0's, in this tree, writing to the same slots.
            pmap = r.maps[0]
            r.fused = [(memo[id(m)], slots, tuple(None if q is None else pmap[id(q)]
                                                  for q in pair))
                       for m, slots, pair in r0.fused]
            # What the next sync checks: parameters added or replaced on this replica's tree.
            r.tree = [(m._parameters, [id(v) for v in m._parameters.values()])
                      for m in memo.values()]
        return [r.module for r in self.replicas]
