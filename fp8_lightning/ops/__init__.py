"""The op registry: each hot operation of the FP8 layer is declared once, here.

==================  =================================================================================================
module              what it declares
==================  =================================================================================================
``registry``        the mechanism: :func:`~fp8_lightning.ops.registry.hot_op` turns one implementation and its fake
                    into the ``torch.library`` op (``torch.ops.fp8_lightning.*``, what ``torch.compile`` traces) and
                    the direct eager call (plain tensors skip the custom-op dispatch); which backend runs a tensor
                    (Triton on CUDA, the C codec on CPU, else the pure-torch reference)
``triton_ops``      the Triton kernels as ops: argument checks, fake outputs, the operands they return
``dispatch``        each hot cast, decode and MX quantization on the backend that runs the tensor, with the
                    reference's bits (the functions the layer, the recipes and the public API call)
``layer``           the traced layer step's opaque ops: MX and rowwise/blockwise casts, the scaled GEMM
==================  =================================================================================================

The pure-torch references stay in ``quantize.py``, ``mx.py``, ``rowwise.py``, ``blockwise.py`` and
``fine_grained.py``; the kernels in ``kernels/`` take and return tensors. Nothing is imported here, so that
``import fp8_lightning.ops.registry`` stays light.
"""
