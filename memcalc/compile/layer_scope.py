"""``compile_scope layer``: each decoder layer is a torch.compile graph of its own.

torchtune compiles per layer (``torchtune/training/_compile.py`` ``compile_model``, 0.6.1: ``m.compile()``
on every ``TransformerSelfAttentionLayer``); the embedding, the final norm and the output head run eagerly,
and ``compile_loss`` compiles the loss apart. Each compiled layer is then its own ``CompiledFunction``
(an ``autograd.Function``: AOTAutograd's ``runtime_wrappers.py`` ``AOTDispatchAutograd``), so:

- its partition is AOTAutograd's min-cut over that layer's joint graph alone: the layer input, the
  parameters and tables made before the layers are graph inputs (never recomputed, never counted as
  saved activations), and the memory budget's knapsack runs per layer graph;
- nothing is recomputed at one layer's backward and kept for another's (``chain_hold`` is empty) and
  inductor's buffer reuse does not reach across graphs (no ``mlp_pool``): each graph's wrapper plans
  its own buffers (``torch/_inductor/codegen/wrapper.py``);
- its saved tensors reach ``ctx.save_for_backward`` together when the layer's forward returns
  (``_AutogradSavedState.save_from_forward``) and come back together when its backward starts
  (``ctx.saved_tensors``): what a saved-tensor hook such as activation offloading sees, one layer at
  a time (:mod:`memcalc.compile.backward`).

The layer graphs are cut out of the whole forward graph :mod:`memcalc.compile.graph` records
(values of one layer; every value of another layer or outside the layers that they read becomes a
graph input), and partitioned once per distinct layer graph.
"""

from __future__ import annotations

from typing import Optional

from memcalc.compile.partitioner import Graph, Partition, Value, choose_saved_values_set


def layer_graph(values: list[Value]) -> tuple[Graph, tuple, dict[int, Value]]:
    """The joint graph of one layer's forward values (the recorded values of one layer, in order):
    fresh copies, each argument from elsewhere made a graph input (a parameter stays one); its
    signature (equal for layers that partition alike) and the copy of each recorded value (by ``id``;
    key ``-1``: the layer input, the first activation the layer reads from outside)."""
    own = {id(v): i for i, v in enumerate(values)}
    ins: dict[int, Value] = {}
    out: list[Value] = []
    copy: dict[int, Value] = {}
    sig: list[tuple] = []
    first: Optional[Value] = None
    for v in values:
        args: list[Value] = []
        arg_sig: list[tuple] = []
        for a in v.args:
            if id(a) in own:
                args.append(copy[id(a)])
                arg_sig.append(("own", own[id(a)]))
                continue
            got = ins.get(id(a))
            if got is None and first is None and not a.param:
                # the first activation read from outside: the layer input (the input norm reads it first)
                got = first = ins[id(a)] = Value(a.name, a.nbytes, "input", [], bw_read=a.bw_read,
                                                 bw_materialized=a.bw_materialized)
                out.append(got)
            elif got is None:
                got = ins[id(a)] = Value(a.name, a.nbytes, "input", [], param=a.param, bw_read=a.bw_read,
                                         bw_materialized=a.bw_materialized)
                out.append(got)
            args.append(got)
            arg_sig.append(("in", a.nbytes, a.param, a.bw_read, a.bw_materialized))
        c = Value(v.name, v.nbytes, v.kind, args, flops=v.flops, bw_read=v.bw_read,
                  bw_materialized=v.bw_materialized, param=v.param, layer=v.layer, extern_aux=v.extern_aux)
        out.append(c)
        copy[id(v)] = c
        sig.append((v.nbytes, v.kind, v.flops, v.bw_read, v.bw_materialized, v.param, v.extern_aux,
                    tuple(arg_sig)))
    if first is not None:
        copy[-1] = first  # (no id is -1)
    return Graph(out), tuple(sig), copy


def partition_layers(g: Graph, outputs: dict[int, Value],
                     budget: float) -> dict[int, tuple[Partition, Optional[Value], bool]]:
    """Each layer's partition at ``budget``, with the copy of its output value in that layer graph
    (``outputs``: each layer's recorded output) and whether it saves its input (a layer whose input
    needs no gradient, the first over a frozen embedding, keeps neither it nor its norm statistics);
    layers of the same signature share one partition."""
    by_layer: dict[int, list[Value]] = {}
    for v in g.values:
        if v.layer is not None:
            by_layer.setdefault(v.layer, []).append(v)
    done: dict[tuple, tuple[Partition, dict[int, Value], list[Value]]] = {}
    got: dict[int, tuple[Partition, Optional[Value], bool]] = {}
    for i, out in outputs.items():
        values = by_layer.get(i, [])
        lg, sig, copy = layer_graph(values)
        hit = done.get(sig)
        if hit is None:
            hit = done[sig] = (choose_saved_values_set(lg, budget), copy, values)
        part, first_copy, first_values = hit
        # the output's place in this layer is its place in the layer the partition was made for
        pos = next((k for k, v in enumerate(values) if v is out), None)
        x = first_copy.get(-1)
        got[i] = (part, first_copy[id(first_values[pos])] if pos is not None else None,
                  x is not None and x in set(part.saved))
    return got


def saved_order(part: Partition) -> tuple[tuple[int, bool], ...]:
    """The layer graph's saved tensors as ``ctx.save_for_backward`` receives them: (bytes, a
    parameter?) each, graph inputs first (parameters are passed as the ``nn.Parameter`` objects
    themselves; the layer input is an activation), then the saved activations in forward order.
    The other graph inputs (the layer input, tables made before the layers) are left out: the
    compiled layer strategy saves them as its region inputs."""
    first = [v for v in part.saved if v.kind == "input" and v.param]
    rest = [v for v in part.saved if v.kind != "input"]
    rest.sort(key=lambda v: v.order)
    return tuple((v.nbytes, True) for v in first) + tuple((v.nbytes, False) for v in rest)


def layer_saved_bytes(part: Partition, out: Optional[Value]) -> int:
    """The layer graph's saved activations besides its own output (which the next layer holds as
    its input)."""
    return sum(v.nbytes for v in part.saved if v.kind != "input" and v is not out)
