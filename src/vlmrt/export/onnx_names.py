"""Renaming one tensor everywhere it is produced or read in an ONNX graph."""

from __future__ import annotations

import onnx


def rename_tensor(g: onnx.GraphProto, old: str, new: str, skip: onnx.NodeProto | None = None) -> None:
    """Every node output and input named old becomes new (skip's inputs are left as they are)."""
    for n in g.node:
        for j, o in enumerate(n.output):
            if o == old:
                n.output[j] = new
        if n is skip:
            continue
        for j, i in enumerate(n.input):
            if i == old:
                n.input[j] = new
