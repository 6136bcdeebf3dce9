"""A decoder graph's MatMul weights left in its data file while quantize.quantize_decoder rewrites the graph, each read
when its node is quantized (export memory: at Gemma 4 E2B's full depth the layers' float32 weights are ~7 GB, which
read into the graph proto whole were held beside their transposed, fused and quantized copies).

The passes are quantize.py's, in its order, on stand-ins: gemm_to_matmul's transposed weight and
fuse_shared_input_matmuls' concatenated one are empty initializers (name, dims, type) whose values this records how to
read (the data file through np.memmap, transposed, concatenated); `quantize_matmuls` then does what ORT's
MatMulNBitsQuantizer does for a 2-D weight (QOperator, symmetric: DefaultWeightOnlyQuantizer.quantize_matmul) with the
same kernel, names, attributes and initializer order, one weight in memory at a time. So the graph written back is the
one the in-memory passes write, byte for byte (tests/test_file_weights.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper


class FileWeights:
    """Float weights [K, N] of a graph read without their external data (onnx.load(..., load_external_data=False)):
    name -> how to read its values; `placeholder` makes the empty initializer a pass puts in the graph instead."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.readers: dict[str, Callable[[], np.ndarray]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.readers

    def defer(self, model: onnx.ModelProto, skip: set[str]) -> None:
        """Every external 2-D float initializer that nodes read only as a MatMul's or Gemm's weight (input 1) stays in
        the data file (a reader recorded); every other external one, but those in skip, is loaded into the graph."""
        g = model.graph
        other: set[str] = set()
        for n in g.node:
            for k, i in enumerate(n.input):
                if not (k == 1 and n.op_type in ("MatMul", "Gemm")):
                    other.add(i)
        for init in g.initializer:
            if not external_data_helper.uses_external_data(init) or init.name in skip:
                continue
            if (len(init.dims) == 2 and init.name not in other
                    and init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)):
                self.readers[init.name] = self._mapped(init)
                continue
            external_data_helper.load_external_data_for_tensor(init, str(self.folder))
            init.data_location = onnx.TensorProto.DEFAULT
            del init.external_data[:]

    def _mapped(self, init: onnx.TensorProto) -> Callable[[], np.ndarray]:
        info = {e.key: e.value for e in init.external_data}
        path, offset = self.folder / info["location"], int(info.get("offset", 0))
        dtype, shape = onnx.helper.tensor_dtype_to_np_dtype(init.data_type), tuple(int(d) for d in init.dims)

        def read() -> np.ndarray:
            m = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
            try:
                return np.array(m)
            finally:
                del m
        return read

    def placeholder(self, name: str, dims, data_type: int, read: Callable[[], np.ndarray]) -> onnx.TensorProto:
        self.readers[name] = read
        t = onnx.TensorProto(name=name, data_type=data_type)
        t.dims.extend(int(d) for d in dims)
        return t

    def transposed(self, name: str, new: str, init: onnx.TensorProto) -> onnx.TensorProto:
        """gemm_to_matmul's Wᵀ of the deferred weight `name` (initializer init), as the stand-in `new`."""
        read = self.readers[name]
        return self.placeholder(new, list(init.dims)[::-1], init.data_type, lambda: np.ascontiguousarray(read().T))

    def concatenated(self, inits: list[onnx.TensorProto], new: str) -> onnx.TensorProto:
        """fuse_shared_input_matmuls' weights side by side along N, as the stand-in `new` (a member in the graph, too
        small for the data file, is read now)."""
        reads = [self.readers.get(i.name) or (lambda a=numpy_helper.to_array(i): a) for i in inits]
        dims = [int(inits[0].dims[0]), sum(int(i.dims[1]) for i in inits)]
        return self.placeholder(new, dims, inits[0].data_type, lambda: np.concatenate([r() for r in reads], axis=1))

    def array(self, init: onnx.TensorProto) -> np.ndarray:
        """A weight's values: read where deferred, else from the graph."""
        read = self.readers.get(init.name)
        return read() if read is not None else numpy_helper.to_array(init)

    def load_rest(self, model: onnx.ModelProto) -> None:
        """The deferred weights still in the graph, with their values (a stand-in from its reader, an untouched one
        from the data file, as onnx loads it)."""
        g = model.graph
        for k, init in enumerate(g.initializer):
            if init.name not in self.readers:
                continue
            if external_data_helper.uses_external_data(init):
                external_data_helper.load_external_data_for_tensor(init, str(self.folder))
                init.data_location = onnx.TensorProto.DEFAULT
                del init.external_data[:]
            else:
                g.initializer[k].CopyFrom(numpy_helper.from_array(self.readers[init.name](), init.name))
        self.readers.clear()


def quantizable(model: onnx.ModelProto, exclude: set[str]) -> list[onnx.NodeProto]:
    """The MatMuls that MatMulNBitsQuantizer quantizes: a constant weight, not excluded."""
    inits = {i.name for i in model.graph.initializer}
    return [n for n in model.graph.node
            if n.op_type == "MatMul" and n.name not in exclude and len(n.input) > 1 and n.input[1] in inits]


def quantize_matmuls(model: onnx.ModelProto, weights: FileWeights, bits: int, block_size: int,
                     accuracy_level: int | None, exclude: set[str]) -> None:
    """MatMulNBitsQuantizer(model, bits, block_size, is_symmetric=True, accuracy_level, nodes_to_exclude=exclude)
    .process() for graphs whose quantized MatMuls all have 2-D weights (the caller checks: `all_2d`), each weight read
    (weights.array) and quantized in turn by ORT's kernel, its float copy dropped before the next."""
    import onnx_ir as ir
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    if not any(o.domain == "com.microsoft" for o in model.opset_import):  # (ONNXModel.set_opset_import)
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    for o in model.opset_import:
        if o.domain == "com.microsoft":
            o.version = 1
    kernel = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    kpack = 8 // bits
    nodes = []
    for node in g.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if w is None or node.name in exclude:
            nodes.append(node)
            continue
        b = weights.array(w)
        if b.ndim != 2:
            raise ValueError(f"{w.name}: a {b.ndim}-D MatMul weight (the file-read quantizer takes 2-D ones)")
        rows, cols = b.shape  # (DefaultWeightOnlyQuantizer.qbits_block_quant, QOperator)
        k_blocks = (rows + block_size - 1) // block_size
        blob = (block_size + kpack - 1) // kpack
        if k_blocks * block_size > rows:
            b = np.pad(b, ((0, k_blocks * block_size - rows), (0, 0)), "constant")
        packed = np.zeros((cols, k_blocks, blob), dtype="uint8")
        zero_point = np.zeros((cols, (k_blocks + kpack - 1) // kpack), dtype="uint8")
        scales = np.zeros((cols, k_blocks), dtype=b.dtype)
        kernel(packed, b, scales, zero_point, block_size, cols, rows, True)
        del b
        q = ir.serde.serialize_tensor(ir.Tensor(packed, name=w.name + f"_Q{bits}"))
        s = ir.serde.serialize_tensor(ir.Tensor(scales, name=w.name + "_scales"))
        g.initializer.extend([q, s])
        attrs = dict(K=rows, N=cols, bits=bits, block_size=block_size,
                     **({"accuracy_level": accuracy_level} if accuracy_level else {}))
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], q.name, s.name], [node.output[0]],
                                      name=node.name + f"_Q{bits}" if node.name else "", domain="com.microsoft",
                                      **attrs))
    del g.node[:]
    g.node.extend(nodes)
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}  # (clean_initializers)
    keep = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)


def all_2d(model: onnx.ModelProto, exclude: set[str]) -> bool:
    """Whether every MatMul that MatMulNBitsQuantizer would quantize has a 2-D weight (quantize_matmuls' form)."""
    dims = {i.name: len(i.dims) for i in model.graph.initializer}
    return all(dims[n.input[1]] == 2 for n in quantizable(model, exclude))
