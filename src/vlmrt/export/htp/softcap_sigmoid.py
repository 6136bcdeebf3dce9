"""A graph output c·tanh(y) (Gemma's final logit soft-capping, tanh(x / c)·c) computed as 2c·sigmoid(2y) − c.

The same function; the HTP (its x86-64 simulator in onnxruntime-qnn, htp_arch 79) computes the 16-bit QDQ Tanh wrong
on a [16, vocab] tensor: rows 0-1 right, later rows off by up to the whole ±1 range (rows 2-3, 6-7, ... or every row
past 1, by the data), so a prefill graph of AR 16 gave a wrong first token whenever a prompt's last block held more than
2 rows. Measured on a small QDQ graph (MatMul, Div by c, Tanh, Mul by c; tests/test_htp_softcap_sigmoid.py): the Tanh's
own output is off there (so is anything after it: a Mul or Div by c, a Mul by a [1, vocab] or [16, vocab] constant, a
Reshape to one row before the Mul); a Sigmoid in its place is right in every row (within 0.1 of the CPU EP's), and
so is the form here. Only a Tanh whose result a graph output's Mul by a scalar constant reads is rewritten: the other
families' Tanh (a vision tower's tanh GELU) stay as they are.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def softcap_as_sigmoid(model: onnx.ModelProto) -> int:
    """Rewrite each graph output Mul(Tanh(y), c), c a scalar initializer, as Add(Mul(Sigmoid(Mul(y, 2)), 2c), −c), in
    place, before quantization (the quantizer gives the new ops their QDQ). Returns how many."""
    g = model.graph
    made = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    readers = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    done = 0
    for out in g.output:
        mul = made.get(out.name)
        if mul is None or mul.op_type != "Mul":
            continue
        j = next((j for j, i in enumerate(mul.input) if i in made and made[i].op_type == "Tanh"), None)
        c = inits.get(mul.input[1 - j]) if j is not None else None
        if c is None or numpy_helper.to_array(c).size != 1 or readers[mul.input[j]] != 1:
            continue
        tanh, cap = made[mul.input[j]], float(numpy_helper.to_array(c).reshape(()))
        dt = numpy_helper.to_array(c).dtype
        name = out.name + "_softcap"
        g.initializer.extend(numpy_helper.from_array(np.array(v, dt), f"{name}_{k}")
                             for k, v in (("two", 2.0), ("twice_cap", 2 * cap), ("minus_cap", -cap)))
        new = [helper.make_node("Mul", [tanh.input[0], f"{name}_two"], [f"{name}_doubled"], name=f"{name}_doubled"),
               helper.make_node("Sigmoid", [f"{name}_doubled"], [f"{name}_sigmoid"], name=f"{name}_sigmoid"),
               helper.make_node("Mul", [f"{name}_sigmoid", f"{name}_twice_cap"], [f"{name}_scaled"], name=f"{name}_scaled"),
               helper.make_node("Add", [f"{name}_scaled", f"{name}_minus_cap"], [out.name], name=name)]
        nodes = [n for n in g.node if n is not tanh and n is not mul]
        at = next((k + 1 for k, n in enumerate(nodes) if tanh.input[0] in n.output), 0)
        del g.node[:]
        g.node.extend(nodes[:at] + new + nodes[at:])
        made = {o: n for n in g.node for o in n.output}
        done += 1
    return done
