"""A bf16 CPU decoder's layers for a step of decodes and verification windows in one C call
(engine/decode_stack.c), built with the machine's C compiler at first use and loaded with ctypes.

Why: with every piece of a layer in C already (the int4 and bf16 matmuls, the paged-decode attention,
the row operations), about half of a one-row step of the Qwen2.5-Coder-0.5B int4 draft was the Python
around them (AMD EPYC, 2 threads: ~9 of ~18 ms; a dozen module calls, ctypes conversions and output
tensors a layer). The stack makes the same C calls in the same order, so its output is the module
path's bit for bit; the draft proposes the same tokens and the target verifies to the same logits.

What it takes (`build_decode_stack`, else None and the modules run as before): a family whose forward
is the plain layer stack (`CausalDecoder.plain_layer_stack`: Llama, Mistral, Qwen2; not Qwen3's q/k
norms, not Gemma) in bf16 on the CPU whose linear layers all run one of our kernels for few rows (int4
tiled layers, a draft's row-routed ones, or bf16 `SmallBatchLinear`), with our row operations and the
paged-decode attention bound. Which steps: those whose every sequence attends through the paged-decode
kernel (decodes and windows of at most `SMALL_QUERY_ROWS` rows) and whose rows every layer sends to its
kernel; a step with a prefill chunk runs the modules. `SPECSERVE_DECODE_STACK=0` turns it off (A/B
runs). A caller that swaps a model's modules or kernels afterwards drops the stack first
(`use_decode_stack(model, None)`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .attention import AttentionMetadata, KernelPagedAttention, paged_decode_view
from .c_library import build_for_process, build_library, int_function
from .models.decoder import CausalDecoder, KVCache
from .models.layers import Attention, DecoderLayer, RMSNorm
from .models.small_batch_linear import MAX_KERNEL_ROWS, SmallBatchLinear
from .quantization import Int4TiledLinear
from .row_ops_kernel import RowOpsKernel
from .row_routed_linear import RowRoutedLinear

logger = logging.getLogger("specserve.engine")

SOURCE = Path(__file__).with_name("decode_stack.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_INT4, _BF16 = 0, 1  # decode_stack.c's LINEAR_INT4, LINEAR_BF16
_ERRORS = {-1: "could not allocate its scratch", -3: "a linear layer of an unknown kind"}


class _Linear(ctypes.Structure):  # decode_stack.c's Linear
    _fields_ = [
        ("kind", _I),
        ("function", _P),
        ("weight", _P),
        ("scales_and_zeros", _P),
        ("bias", _P),
        ("out_features", _I),
        ("in_features", _I),
        ("group_size", _I),
    ]


class _Layer(ctypes.Structure):  # decode_stack.c's Layer
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


class _Stack(ctypes.Structure):  # decode_stack.c's Stack
    _fields_ = [
        ("add_rms_norm", _P),
        ("rope", _P),
        ("silu_mul", _P),
        ("paged_decode", _P),
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("intermediate", _I),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos", _P),
        ("sin", _P),
        ("table_rows", _I),
        ("final_norm", _P),
    ]


@dataclass(frozen=True)
class DecodeStackKernel:
    path: Path  # the loaded shared library
    function: Callable[..., int]  # decode_stack (ctypes, argtypes set)


def build_decode_stack_kernel(
    cache_dir: Path, compiler: str = "gcc", defines: tuple[str, ...] = ()
) -> DecodeStackKernel:
    """Compile (or reuse) and load the library. Raises KernelBuildError."""
    target, library = build_library(SOURCE, cache_dir, compiler, defines)
    arguments = [_P, _P, _I, _P, _P, _I, _P, _P, _P, _P, _I, _I, ctypes.c_int]
    return DecodeStackKernel(path=target, function=int_function(library, "decode_stack", *arguments))


@functools.cache
def default_decode_stack_kernel() -> DecodeStackKernel | None:
    """The library for this process (`build_for_process`); None (one info line) where it cannot be
    built, or when SPECSERVE_DECODE_STACK=0."""
    return build_for_process(
        "SPECSERVE_DECODE_STACK",
        build_decode_stack_kernel,
        lambda e: logger.info("decoder layers run as modules: %s", e),
    )


def _address(function: Callable[..., int]) -> int:
    """The C address of a ctypes function (the stack calls the kernels' own libraries through it)."""
    address = ctypes.cast(function, ctypes.c_void_p).value  # type: ignore[arg-type]  # a ctypes function
    assert address is not None
    return address


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class DecodeStack:
    """One model's layers as `decode_stack.c` sees them: the weights' addresses, laid out once."""

    def __init__(
        self,
        kernel: DecodeStackKernel,
        stack: _Stack,
        layers: ctypes.Array[_Layer],
        attention: Attention,
        max_rows: int,
        keep: list[torch.Tensor],
    ):
        self.kernel = kernel
        self._stack = stack
        self._layers = layers
        # The first layer's attention module and the backend every layer was bound to when the stack
        # was built: a model bound to another backend since runs the modules.
        self._attention, self._backend = attention, attention.attention_backend
        self.max_rows = max_rows  # the most rows every layer sends to its kernel
        self._keep = keep  # the tensors whose addresses the structures hold
        self._cache: tuple[torch.Tensor, ...] = ()  # the KV cache whose addresses `_layers` holds

    def __call__(
        self,
        embedded: torch.Tensor,  # [T, hidden] bf16: the step's token embeddings
        positions: torch.Tensor,  # [T] int64
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:  # [T, hidden] final-normed hidden states; None: run the modules
        rows = embedded.shape[0]
        if (
            rows > self.max_rows
            or self._attention.attention_backend is not self._backend
            or embedded.dtype != torch.bfloat16
        ):
            return None
        view = paged_decode_view(meta)
        if view is None or not self._bind(kv_cache):
            return None
        assert view.seq_info is not None
        embedded = embedded.contiguous()
        positions = positions.to(torch.int64).contiguous()
        slot_mapping = view.slot_mapping.contiguous()
        out = torch.empty(rows, self._stack.hidden, dtype=torch.bfloat16)  # [T, hidden]
        rc = self.kernel.function(
            ctypes.byref(self._stack),
            self._layers,
            len(self._layers),
            embedded.data_ptr(),
            out.data_ptr(),
            rows,
            positions.data_ptr(),
            slot_mapping.data_ptr(),
            view.seq_info.data_ptr(),
            view.context_slots.data_ptr(),
            view.context_slots.shape[1],
            view.seq_info.shape[0],
            torch.get_num_threads(),
        )
        if rc == -2:  # as the modules' rope (torch's index_select) raises
            raise IndexError(f"rope: a position outside the table's {self._stack.table_rows} rows")
        if rc != 0:
            raise MemoryError(f"decode stack: {_ERRORS.get(rc, f'error {rc}')}")
        return out

    def _bind(self, kv_cache: KVCache) -> bool:
        """Point the layers at `kv_cache` unless they point there already; False (the modules run the
        step) for a cache the stack does not read: another layer count, dtype or layout."""
        tensors = tuple(t for pair in kv_cache for t in pair)
        if len(tensors) == len(self._cache) and all(
            a is b for a, b in zip(tensors, self._cache, strict=True)
        ):
            return True
        if len(kv_cache) != len(self._layers) or not all(
            t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for t in tensors
        ):
            return False
        for layer, (k, v) in zip(self._layers, kv_cache, strict=True):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
        self._cache = tensors
        return True


def _linear(module: nn.Module, keep: list[torch.Tensor]) -> tuple[_Linear, int] | None:
    """A linear layer as the stack calls it and the most rows it sends to that kernel; None where it
    runs something else (torch's kernels, int8, a float32 layer)."""
    limit = 1 << 62
    if isinstance(module, RowRoutedLinear):  # a draft's: the quantized kernel below its crossover
        limit = module.min_float_rows - 1
        module = module.quantized
    if isinstance(module, Int4TiledLinear):
        function = module.kernel.function_for(module.int8_activations)
        if function is None or module.bias is not None and module.bias.dtype != torch.bfloat16:
            return None
        tensors = [module.qweight, module.scales_and_zeros] + ([] if module.bias is None else [module.bias])
        keep += tensors
        layer = _Linear(
            _INT4,
            _address(function),
            module.qweight.data_ptr(),
            module.scales_and_zeros.data_ptr(),
            _pointer(module.bias),
            module.out_features,
            module.in_features,
            module.group_size,
        )
        return layer, limit
    if isinstance(module, SmallBatchLinear):
        weight, bias = module.weight, module.bias
        if weight.dtype != torch.bfloat16 or not weight.is_contiguous() or weight.device.type != "cpu":
            return None
        if bias is not None and bias.dtype != torch.bfloat16:
            return None
        keep += [weight] + ([] if bias is None else [bias])
        layer = _Linear(
            _BF16,
            _address(module.kernel.function),
            weight.data_ptr(),
            None,
            _pointer(bias),
            module.out_features,
            module.in_features,
            0,
        )
        return layer, min(limit, MAX_KERNEL_ROWS)
    return None


def _norm_weight(module: nn.Module, size: int, row_ops: RowOpsKernel, eps: float) -> torch.Tensor | None:
    """The weight of an RMSNorm that runs `row_ops` with `eps` ([size] bf16); None for any other norm."""
    if type(module) is not RMSNorm or module.row_ops is not row_ops or module.eps != eps:
        return None
    weight = module.weight
    ok = weight.dtype == torch.bfloat16 and weight.is_contiguous() and weight.numel() == size
    return weight if ok else None


def _layer(
    layer: nn.Module,
    attention: Attention,
    hidden: int,
    row_ops: RowOpsKernel,
    eps: float,
    keep: list[torch.Tensor],
) -> tuple[_Layer, int] | None:
    """One decoder layer as the stack calls it and the most rows it may take; None where a part of it
    runs something the stack does not (q/k norms, another norm or activation, another kernel). Every
    layer shares the first one's (`attention`) backend and rotary tables."""
    if type(layer) is not DecoderLayer:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    norms = [
        _norm_weight(n, hidden, row_ops, eps) for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    if (
        norms[0] is None
        or norms[1] is None
        or attn.attention_backend is not attention.attention_backend
        or attn.rope is not attention.rope
        or attn.q_norm is not None
        or not mlp.fused_silu
        or mlp.row_ops is not row_ops
    ):
        return None
    linears = [_linear(m, keep) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    found = [entry for entry in linears if entry is not None]
    if len(found) < len(linears):
        return None
    keep += [norms[0], norms[1]]
    qkv, o, gate_up, down = (entry[0] for entry in found)
    structure = _Layer(norms[0].data_ptr(), norms[1].data_ptr(), qkv, o, gate_up, down, None, None)
    return structure, min(entry[1] for entry in found)


def build_decode_stack(model: CausalDecoder, kernel: DecodeStackKernel) -> DecodeStack | None:
    """`model`'s layers for `kernel`, or None where some part of it runs something the stack does not
    (see the module docstring)."""
    if not model.plain_layer_stack:
        return None
    layers, norm = list(model.get_submodule("layers").children()), model.get_submodule("norm")
    if not layers or not isinstance(norm, RMSNorm):
        return None
    cfg = model.config
    first = layers[0]
    if not isinstance(first, DecoderLayer):
        return None
    attention, rope, row_ops = first.self_attn, first.self_attn.rope, norm.row_ops
    backend = attention.attention_backend
    if (
        row_ops is None
        or rope.row_ops is not row_ops
        or not isinstance(backend, KernelPagedAttention)
        or not backend.kernel.supports(torch.bfloat16, torch.bfloat16, cfg.head_dim)
        or rope.cos.dtype != torch.float32
        or not (rope.cos.is_contiguous() and rope.sin.is_contiguous())
    ):
        return None
    final_norm = _norm_weight(norm, cfg.hidden_size, row_ops, norm.eps)
    if final_norm is None:
        return None
    keep: list[torch.Tensor] = [final_norm, rope.cos, rope.sin]
    structures, max_rows = [], 1 << 62
    for layer in layers:
        entry = _layer(layer, attention, cfg.hidden_size, row_ops, norm.eps, keep)
        if entry is None:
            return None
        structures.append(entry[0])
        max_rows = min(max_rows, entry[1])
    if max_rows < 1:
        return None
    stack = _Stack(
        _address(row_ops.add_rms_norm_function),
        _address(row_ops.rope_function),
        _address(row_ops.silu_mul_function),
        _address(backend.kernel.function),
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        norm.eps,
        attention.scale,
        rope.cos.data_ptr(),
        rope.sin.data_ptr(),
        rope.cos.shape[0],
        final_norm.data_ptr(),
    )
    array = (_Layer * len(structures))(*structures)
    return DecodeStack(kernel, stack, array, attention, max_rows, keep)


def use_decode_stack(model: CausalDecoder, kernel: DecodeStackKernel | None) -> bool:
    """Give `model` its stack for `kernel` (None: drop it, the modules run every step); returns
    whether it has one now."""
    model.decode_stack = None if kernel is None else build_decode_stack(model, kernel)
    return model.decode_stack is not None
