"""CUDA's autocast on CPU tensors: the accountant measures on the CPU what a client under mixed
precision holds on a GPU, and the two devices' autocast lists differ. On CUDA, layer norm, softmax,
log-softmax, sums and the losses run in float32 (their inputs cast up, their outputs float32); on
the CPU they run in the lower precision, and the CPU casts a few ops CUDA leaves alone (`cat`,
`stack`, the FFTs). For a ViT at batch 128 under bf16-mixed the CPU's lists put the estimate at 0.876
of `torch.cuda.max_memory_allocated` on an H200 (benchmarks/RESULTS.md, fourth lease).

`cuda_autocast_on_cpu` runs the CPU's autocast with every one of its per-op kernels replaced for the
block: the ops CUDA's autocast registers get CUDA's cast policy, written here in Python after
ATen's `autocast_mode.h`/`.cpp` (the lists are `CUDA_CAST_POLICIES`, checked against the ops the
installed torch's `AutocastCUDA` key holds in tests/accounting/test_cuda_autocast.py, whose dtypes are
also checked against CUDA's own kernels run on fake CUDA tensors); the ops only the CPU registers
fall through, as on CUDA. The replacement kernels are registered with `torch.library` on entry and
removed on exit, so the CPU's own autocast is back afterwards; they are process-wide meanwhile, which
is why only the accountant enters this, and only where clients train on CUDA (no client of the
process then trains under the CPU's autocast).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

CUDA_CAST_POLICIES: dict[str, tuple[str, ...]] = {
    # Cast every floating argument to the autocast dtype (float32 weights that require grad cached).
    "lower_precision_fp": (
        "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
        "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
        "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
        "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "cudnn_convolution",
        "cudnn_convolution_transpose", "_cudnn_rnn",
    ),
    # Cast every floating argument to float32.
    "fp32": (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
        "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
        "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
        "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
        "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
        "linalg_matrix_sqrth",  # registered outside those lists; CUDA's kernel returns float32 for bf16
    ),
    # Ask for a float32 result (the op's optional dtype) where the first argument is eligible.
    "fp32_set_opt_dtype": (
        "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
        "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
    ),
    # Call the overload that takes a dtype, with float32, where the first argument is eligible.
    "fp32_append_dtype": ("norm.Scalar", "norm.ScalarOpt_dim"),
    # Cast every floating argument to the widest floating type among them.
    "promote": (
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot", "scatter_add",
    ),
    # CUDA refuses it under autocast (an error naming binary_cross_entropy_with_logits instead).
    "banned": ("binary_cross_entropy",),
}
"""ATen's CUDA autocast lists (`AT_FORALL_LOWER_PRECISION_FP`, `AT_FORALL_FP32`,
`AT_FORALL_FP32_SET_OPT_DTYPE`, `AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`, `AT_FORALL_PROMOTE`, and
the cuDNN kernels, the ban and `linalg_matrix_sqrth` registered beside them), by policy, as `op` or
`op.overload`."""

_POLICY_OF = {name: policy for policy, names in CUDA_CAST_POLICIES.items() for name in names}

DTYPE_OVERLOADS = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
"""fp32_append_dtype: the overload each op is redispatched to, with float32 appended."""

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _overload(name: str) -> torch._ops.OpOverload:
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _eligible(arg: object) -> bool:
    """What autocast casts: a floating tensor on the device, not float64 (ATen's `is_autocast_eligible`)."""
    return isinstance(arg, Tensor) and arg.is_floating_point() and arg.dtype != torch.float64 and arg.device.type == "cpu"


class _Policies:
    """The replacement kernels of one `cuda_autocast_on_cpu` block and their cast cache."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.cache: dict[int, tuple[Tensor, Tensor]] = {}

    def cast(self, to: torch.dtype, arg: Any) -> Any:
        """ATen's `cached_cast`: eligible tensors (also inside lists) to `to`; a float32 leaf weight
        that requires grad is cast to the lower precision once per block."""
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.cast(to, a) for a in arg)
        if not _eligible(arg) or arg.dtype == to:
            return arg
        if to == self.dtype and arg.dtype == torch.float32 and arg.requires_grad and arg.is_leaf and not arg._is_view():
            if id(arg) not in self.cache:
                self.cache[id(arg)] = (arg, arg.to(to))
            return self.cache[id(arg)][1]
        return arg.to(to)

    def widest(self, args: tuple, kwargs: dict) -> torch.dtype:
        """promote's target: float32 if any eligible argument is float32, else the lower precision."""
        flat = [a for arg in (*args, *kwargs.values()) for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
        return torch.float32 if any(_eligible(a) and a.dtype == torch.float32 for a in flat) else self.dtype

    def kernel(self, name: str, policy: str) -> Callable[..., Any]:
        """The AutocastCPU kernel of op `name` under CUDA's `policy` (a key of `CUDA_CAST_POLICIES`)."""
        op = _overload(name)
        dtype_slot = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

        def cast_all(*args: Any, **kwargs: Any) -> Any:
            to = {"lower_precision_fp": self.dtype, "fp32": torch.float32}.get(policy) or self.widest(args, kwargs)
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                return op(*self.cast(to, args), **{k: self.cast(to, v) for k, v in kwargs.items()})

        def float32_result(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                if not (args and _eligible(args[0])):
                    return op(*args, **kwargs)
                if policy == "fp32_append_dtype":
                    return _overload(DTYPE_OVERLOADS[name])(*args, torch.float32, **kwargs)
                if op._schema.arguments[dtype_slot].kwarg_only:
                    kwargs["dtype"] = kwargs.get("dtype") or torch.float32
                else:
                    args = (*args, *[a.default_value for a in op._schema.arguments[len(args) : dtype_slot + 1]])
                    args = (*args[:dtype_slot], args[dtype_slot] or torch.float32, *args[dtype_slot + 1 :])
                return op(*args, **kwargs)

        def banned(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name} is unsafe to autocast on CUDA: use binary_cross_entropy_with_logits")

        if policy == "banned":
            return banned
        return float32_result if policy.startswith("fp32_") else cast_all


@functools.cache
def registered_autocast_ops(key: str) -> frozenset[str]:
    """The aten ops with a kernel of their own for dispatch key `key`, as `op` or `op.overload`
    (torch's own registrations: asked first before any block replaces them)."""
    names = (n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::"))
    return frozenset(n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{n}", key))


@contextlib.contextmanager
def cuda_autocast_on_cpu(dtype: torch.dtype) -> Iterator[None]:
    """Autocast of CPU tensors to `dtype` under CUDA's per-op policies instead of the CPU's."""
    policies = _Policies(dtype)
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid")  # replacing the CPU's kernels is the point
            for name in sorted(registered_autocast_ops("AutocastCPU") | (_POLICY_OF.keys() & registered_autocast_ops("AutocastCUDA"))):
                kernel = policies.kernel(name, _POLICY_OF[name]) if name in _POLICY_OF else torch.library.fallthrough_kernel
                library.impl(name, kernel, "AutocastCPU")
        with torch.autocast("cpu", dtype=dtype):
            yield
    finally:
        policies.cache.clear()
        library._destroy()
