"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss): a router sends each token to k
experts.

    router   logits = x @ W_r^T [T, E]; softmax over all E experts in float32; the k largest
             probabilities and their expert ids. `renormalize` rescales a token's k weights to sum
             to 1 (Mixtral always, Qwen3-MoE when `norm_topk_prob`): the same as a softmax over
             the k chosen logits alone
    experts  expert e is a gated MLP: down_e(act(gate_e x, up_e x)), its weights stacked as
             gate_up_proj [E, 2*I, H] (gate rows, then up rows) and down_proj [E, H, I]; act is
             SiLU-and-mul, or gpt-oss's clamped SwiGLU (`MoeActivation`); gpt-oss adds a bias to
             each projection (gate_up_proj_bias [E, 2*I], down_proj_bias [E, H]). Nemotron's
             experts are not gated: down_e(relu(up_e x)^2), gate_up_proj holding up alone
             [E, I, H]
    output   y_t = sum over the k choices j of w_tj * expert_{e_tj}(x_t)

On CUDA the experts run as paged_kernels.fused_moe: the T*k (token, choice) slots sorted by
expert on the device into single-expert blocks, and two grouped GEMMs over them (Triton), with
static shapes and no host read, so eager steps do not sync and CUDA graphs capture it. On the CPU
they run grouped in torch: each expert that got tokens runs one gate_up and one down matmul over
its contiguous group of sorted slots, the results go back to their tokens with one index_add
(the group sizes are read on the host, which costs nothing there). Under torch.compile the
experts are one opaque operator (`paged_engine::moe_experts`). `TRITON_ON_CPU` (tests) sends CPU
tensors through the Triton kernels too, which needs Triton's interpreter (TRITON_INTERPRET=1).

Tensor parallelism splits each expert's intermediate dim I like a dense MLP (gate / up rows and
down columns [r*I/tp, (r+1)*I/tp) on rank r): every rank computes a partial sum for every token
and the block all-reduces once (the down bias is added on rank 0 only, so it counts once). The
router is replicated, so all ranks route alike. Expert weights and the router are plain
parameters, not linear layers: the CPU's weight-only quantizations leave them in the model dtype
(quantization="fp8" converts the experts, `FusedMoE.to_fp8`; a 4-bit checkpoint's expert codes
become `int4`, packed_codes.py), and batch_invariant=True does not reach them (an expert's group
size, hence its matmul's shape, depends on the rest of the batch).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.linear import weight_device
from paged_kernels import Fp8Weight, Int4Weight, MoeActivation, Mxfp4Weight, dequantize_mxfp4
from paged_kernels.reference import SILU, check_moe_activation, moe_activation

Weight = torch.Tensor | Mxfp4Weight | Fp8Weight  # stacked [E, rows, cols]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), best first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _expert_mlp(
    x: torch.Tensor,  # [n, H]
    gate_up: torch.Tensor,  # [2I, H] ([I, H] not gated)
    down: torch.Tensor,  # [H, I]
    gate_up_bias: torch.Tensor | None,  # [2I]
    down_bias: torch.Tensor | None,  # [H]
    act: MoeActivation,
) -> torch.Tensor:  # [n, H]
    """One expert over rows x (a non-gated activation: `gate_up` is the up projection alone)."""
    h = F.linear(x, gate_up, gate_up_bias)
    if not act.gated:
        return F.linear(moe_activation(h, None, act), down, down_bias)
    gate, up = h.chunk(2, dim=-1)
    return F.linear(moe_activation(gate, up, act), down, down_bias)


def _expert(w: Weight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's matrix in `dtype` (an MXFP4, FP8 or int4 one decoded now)."""
    if isinstance(w, Mxfp4Weight):
        return dequantize_mxfp4(Mxfp4Weight(w.blocks[e], w.scales[e]), dtype)
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.weight[e], w.scale[e]).dequantize(dtype)
    if isinstance(w, Int4Weight):
        return Int4Weight(w.packed[e], w.scale[e], w.low[e]).dequantize(dtype)
    return w[e]


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    gate_up: Weight,  # [E, 2I, H] ([E, I, H]: a non-gated activation's up alone)
    down: Weight,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k]
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I]
    down_bias: torch.Tensor | None = None,  # [E, H]
    activation: MoeActivation = SILU,
) -> torch.Tensor:
    """sum_j w_tj * expert_{e_tj}(x_t) -> [T, H] in x's dtype, one matmul pair per used expert."""
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # slot s = token s // k, choice s % k
    order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert, ascending
    num_experts = (gate_up if isinstance(gate_up, torch.Tensor) else gate_up[0]).shape[0]
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    tokens = order // k
    xs = x.index_select(0, tokens)  # [T*k, H]: each slot's token, in expert order
    ys = torch.empty(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            gb = gate_up_bias[e] if gate_up_bias is not None else None
            db = down_bias[e] if down_bias is not None else None
            rows = xs[start : start + n]
            gu, dn = _expert(gate_up, e, x.dtype), _expert(down, e, x.dtype)
            ys[start : start + n] = _expert_mlp(rows, gu, dn, gb, db, activation)
            start += n
    ys *= topk_weights.reshape(-1)[order, None]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, ys).to(x.dtype)


# Tests set this to run the Triton kernels on CPU tensors (under TRITON_INTERPRET=1 only).
TRITON_ON_CPU = False


@functools.cache
def _triton_available() -> bool:
    import paged_kernels

    return paged_kernels.triton_available()


def run_experts(
    x: torch.Tensor,  # [T, H]
    gate_up: Weight,  # [E, 2I, H]
    down: Weight,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k]
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I]
    down_bias: torch.Tensor | None = None,  # [E, H]
    activation: MoeActivation = SILU,
) -> torch.Tensor:
    """The experts' weighted sum [T, H]: the Triton kernels on CUDA (no host sync, capturable),
    else `grouped_experts` (a CUDA device without triton has no graph-capturable attention
    backend either, so it never captures)."""
    if (x.is_cuda or TRITON_ON_CPU) and _triton_available():
        from paged_kernels import fused_moe

        return fused_moe(
            x,
            gate_up,
            down,
            topk_weights,
            topk_ids,
            gate_up_bias=gate_up_bias,
            down_bias=down_bias,
            activation=activation,
        )
    args = (x, gate_up, down, topk_weights, topk_ids, gate_up_bias, down_bias, activation)
    return grouped_experts(*args)


@torch.library.custom_op("paged_engine::moe_experts", mutates_args=())
def _moe_experts_op(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float,
    swiglu_limit: float,
) -> torch.Tensor:
    act = MoeActivation(activation, swiglu_alpha, swiglu_limit)
    return run_experts(x, gate_up, down, topk_weights, topk_ids, gate_up_bias, down_bias, act)


@_moe_experts_op.register_fake
def _(x, gate_up, down, topk_weights, topk_ids, *args) -> torch.Tensor:
    return torch.empty_like(x)


def _check_shape(w: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(w.shape) != expected:
        raise ValueError(f"{what}: expected shape {expected}, got {tuple(w.shape)}")


class FusedMoE(nn.Module):
    """The experts' stacked weights (this rank's slice of I) and their grouped forward.

    `mxfp4=True` keeps them as MXFP4 bytes (`gate_up_proj_blocks` [E, 2I, H/2] and
    `gate_up_proj_scales` [E, 2I, H/32], `down_proj_blocks` [E, H, I/2] and `down_proj_scales`
    [E, H, I/32]; 4.25 bits a weight), which the MoE kernel decodes as it multiplies (the CPU's
    grouped path decodes each used expert per call); loaders take them whole (gate / up rows
    already split), blocks as [.., K/2] or the checkpoint's [.., K/32, 16].

    Loaders (`weight_loader(param, w, shard_id)`) take either a whole fused checkpoint tensor
    (shard_id None: gate_up [E, 2I, H], down [E, H, I]; with `bias`, gate_up_bias [E, 2I] and
    down_bias [E, H] too) or one expert's HF matrix: gate_up with shard_id (expert, 0) for its
    gate [I, H] or (expert, 1) for its up [I, H], down with shard_id expert for its [H, I]. Each
    copies only this rank's slice.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        *,
        bias: bool = False,
        activation: MoeActivation = SILU,
        mxfp4: bool = False,
    ) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"the experts' intermediate size {intermediate_size} is not divisible by "
                f"tensor_parallel_size={self.tp_size}"
            )
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size  # the full I
        i = intermediate_size // self.tp_size
        check_moe_activation(activation)
        self.activation = activation
        # A gated activation reads gate and up halves of gate_up_proj [E, 2I, H]; a non-gated
        # one (Nemotron's relu^2) holds the up projection alone there, [E, I, H].
        self.halves = 2 if activation.gated else 1
        if mxfp4 and not activation.gated:
            raise ValueError(f"MXFP4 experts need a gated activation, not {activation.name!r}")
        self.mxfp4 = mxfp4
        self.fp8: tuple[Fp8Weight, Fp8Weight] | None = None  # set by to_fp8()
        # set by packed_codes.keep_codes: a 4-bit checkpoint's expert codes
        self.int4: tuple[Int4Weight, Int4Weight] | None = None
        if mxfp4:
            self._make_mxfp4(num_experts, hidden_size, i)
        else:
            rows = self.halves * i
            device = weight_device()  # "meta" while a 4-bit checkpoint's codes load
            self.gate_up_proj = nn.Parameter(
                torch.empty(num_experts, rows, hidden_size, device=device)
            )
            self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, i, device=device))
            self.gate_up_proj.weight_loader = self._load_gate_up
            self.down_proj.weight_loader = self._load_down
            # the shards one expert at a time must fill (load_named_weights' missing check)
            halves = (0, 1) if activation.gated else (1,)
            self.gate_up_proj.shard_ids = {(e, h) for e in range(num_experts) for h in halves}
            self.down_proj.shard_ids = set(range(num_experts))
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, self.halves * i))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
            self.gate_up_proj_bias.weight_loader = self._load_gate_up_bias

    def _make_mxfp4(self, num_experts: int, hidden: int, i: int) -> None:
        if hidden % 32 or i % 32:
            raise ValueError(
                f"MXFP4 experts need the hidden size ({hidden}) and each rank's share of the "
                f"intermediate size ({i}, tensor_parallel_size={self.tp_size}) to be multiples "
                "of 32"
            )

        def param(*shape: int, loader, fill) -> nn.Parameter:
            p = nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)
            p.weight_loader, p.dummy_init = loader, fill
            return p

        rows, cols = self._load_gate_up_rows, self._load_down_cols
        self.gate_up_proj_blocks = param(num_experts, 2 * i, hidden // 2, loader=rows, fill=_bytes)
        self.gate_up_proj_scales = param(num_experts, 2 * i, hidden // 32, loader=rows, fill=_scale)
        self.down_proj_blocks = param(num_experts, hidden, i // 2, loader=cols, fill=_bytes)
        self.down_proj_scales = param(num_experts, hidden, i // 32, loader=cols, fill=_scale)

    @torch.no_grad()
    def to_fp8(self) -> int:
        """After loading: the dense experts become FP8 with a scale per output row
        (`quantization="fp8"`), run by the MoE kernel; returns the bytes they now take."""
        from paged_kernels import quantize_fp8_per_channel

        if self.mxfp4 or self.int4 is not None:
            raise ValueError("MXFP4 or int4 experts are not converted to FP8")
        self.fp8 = (
            Fp8Weight(*quantize_fp8_per_channel(self.gate_up_proj)),
            Fp8Weight(*quantize_fp8_per_channel(self.down_proj)),
        )
        del self.gate_up_proj, self.down_proj  # the dense weights are freed
        self.gate_up_proj = self.down_proj = None
        return sum(w.weight.numel() + w.scale.numel() * 4 for w in self.fp8)

    def _copy_halves(self, param: nn.Parameter, w: torch.Tensor) -> None:
        """w [E, gate I | up I, ...] whole (non-gated: [E, up I, ...]): this rank's rows of each
        half into param."""
        i, full = param.shape[1] // self.halves, self.intermediate_size
        begin = self.tp_rank * i
        for h in range(self.halves):
            param.data[:, h * i : (h + 1) * i].copy_(w[:, h * full + begin : h * full + begin + i])

    def _load_gate_up_rows(self, param: nn.Parameter, w: torch.Tensor) -> None:
        """An MXFP4 gate_up tensor [E, gate I | up I, cols]: this rank's rows of both halves."""
        if w.dim() == 4:
            w = w.flatten(-2)
        full = self.intermediate_size
        _check_shape(w, (self.num_experts, 2 * full, param.shape[2]), "experts gate_up (MXFP4)")
        self._copy_halves(param, w)

    def _load_down_cols(self, param: nn.Parameter, w: torch.Tensor) -> None:
        """An MXFP4 down tensor [E, H, I / per]: this rank's columns."""
        if w.dim() == 4:
            w = w.flatten(-2)
        per = self.intermediate_size // (param.shape[2] * self.tp_size)  # 2 or 32
        full = self.intermediate_size // per
        _check_shape(w, (self.num_experts, self.hidden_size, full), "experts down (MXFP4)")
        cols = param.shape[2]
        param.data.copy_(w[:, :, self.tp_rank * cols : (self.tp_rank + 1) * cols])

    def _load_gate_up(
        self, param: nn.Parameter, w: torch.Tensor, shard_id: tuple[int, int] | None = None
    ) -> None:
        i, full = param.shape[1] // self.halves, self.intermediate_size
        begin = self.tp_rank * i
        if shard_id is None:  # [E, gate I | up I, H]: this rank's rows of both halves
            shape = (self.num_experts, self.halves * full, self.hidden_size)
            _check_shape(w, shape, "experts gate_up" if self.halves == 2 else "experts up")
            self._copy_halves(param, w)
            return
        expert, half = shard_id
        if self.halves == 1:  # non-gated: the up projection is all there is
            if half != 1:
                raise ValueError(f"expert {expert}: a gate matrix for non-gated experts")
            half = 0
        _check_shape(w, (full, self.hidden_size), f"expert {expert} {('gate', 'up')[half]}")
        param.data[expert, half * i : (half + 1) * i].copy_(w[begin : begin + i])

    def _load_gate_up_bias(self, param: nn.Parameter, w: torch.Tensor) -> None:
        rows = self.halves * self.intermediate_size
        _check_shape(w, (self.num_experts, rows), "experts gate_up bias")
        self._copy_halves(param, w)

    def _load_down(self, param: nn.Parameter, w: torch.Tensor, shard_id: int | None = None) -> None:
        i, full = param.shape[2], self.intermediate_size
        begin = self.tp_rank * i
        if shard_id is None:
            _check_shape(w, (self.num_experts, self.hidden_size, full), "experts down")
            param.data.copy_(w[:, :, begin : begin + i])
            return
        _check_shape(w, (self.hidden_size, full), f"expert {shard_id} down")
        param.data[shard_id].copy_(w[:, begin : begin + i])

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H], weights / ids [T, k] -> this rank's partial sum [T, H] (not all-reduced)."""
        down_bias = self.down_proj_bias if self.tp_rank == 0 else None  # counted once in the sum
        if self.mxfp4 or self.fp8 is not None or self.int4 is not None:
            if torch.compiler.is_compiling():
                raise NotImplementedError(
                    "MXFP4 / FP8 / int4 experts do not run under a compiled CPU forward "
                    "(compilation_config=0)"
                )
            if self.fp8 is not None or self.int4 is not None:
                gate_up, down = self.fp8 or self.int4
            else:
                gate_up = Mxfp4Weight(self.gate_up_proj_blocks, self.gate_up_proj_scales)
                down = Mxfp4Weight(self.down_proj_blocks, self.down_proj_scales)
            args = (x, gate_up, down, topk_weights, topk_ids, self.gate_up_proj_bias, down_bias)
            return run_experts(*args, self.activation)
        args = (x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        args += (self.gate_up_proj_bias, down_bias)
        if torch.compiler.is_compiling():
            act = self.activation
            return _moe_experts_op(*args, act.name, act.alpha, act.limit)
        return run_experts(*args, self.activation)


def _bytes(p: torch.Tensor, gen: torch.Generator) -> None:
    p.random_(0, 256, generator=gen)  # dummy MXFP4 codes: every value


def _scale(p: torch.Tensor, gen: torch.Generator) -> None:
    p.fill_(119)  # dummy MXFP4 scales, 2^-8: weights within +-6 / 256, like std 0.02


class MoeRouter(nn.Module):
    """The router's logits x @ W^T (+ b) [T, E]; W [E, H] (b [E]) replicated on every rank (HF's
    `gate`, gpt-oss's `router`)."""

    def __init__(self, num_experts: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class SparseMoeBlock(nn.Module):
    """The MLP of a MoE decoder layer: route, run the experts, all-reduce once. [T, H] -> [T, H].

    Submodules carry HF's names (`gate`, `experts`), so fused checkpoints load by name.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        *,
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: MoeActivation = SILU,
        mxfp4: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok={top_k} must be between 1 and the number of experts "
                f"({num_experts})"
            )
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = MoeRouter(num_experts, hidden_size, bias=router_bias)
        self.experts = FusedMoE(
            num_experts,
            hidden_size,
            intermediate_size,
            tp_rank,
            tp_size,
            bias=expert_bias,
            activation=activation,
            mxfp4=mxfp4,
        )

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of x [T, H]: softmax top-k, renormalized when
        `renormalize`; a family with its own routing (DBRX, Phi-MoE) overrides this alone."""
        return route(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.select_experts(x)
        out = self.experts(x, weights, ids)
        return tp_all_reduce(out) if self.experts.tp_size > 1 else out


class ActExperts(FusedMoE):
    """Routed experts whose gated activation is `act` ([.., 2I] gate | up -> [.., I]), run
    grouped in torch (unquantized weights, eager only: the expert ids are read on the host),
    each used expert once over its tokens."""

    def __init__(self, act: nn.Module, *args: int | None) -> None:
        super().__init__(*args)  # FusedMoE's (num_experts, hidden, intermediate[, tp rank, size])
        self.act = act

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if not isinstance(self.gate_up_proj, torch.Tensor):
            raise ValueError("clamped SwiGLU experts run unquantized weights only")
        if x.is_cuda and torch.cuda.is_current_stream_capturing():  # the loop reads ids
            raise ValueError("clamped SwiGLU experts cannot run in a CUDA graph (enforce_eager)")
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        out = torch.zeros_like(x)
        for e in flat.unique().tolist():
            slots = (flat == e).nonzero().squeeze(1)
            tokens = slots // k
            h = self.act(F.linear(x[tokens], self.gate_up_proj[e]))
            y = F.linear(h, self.down_proj[e]) * topk_weights.reshape(-1)[slots, None]
            out.index_add_(0, tokens, y.to(x.dtype))
        return out
