"""Activations: gated SiLU for Llama-style MLPs (any other activation gated alike), the GELU /
ReLU variants of older models and Apertus's learned xIELU."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x: [T, 2*I] holding (gate | up) -> silu(gate) * up: [T, I]."""

    # paged_kernels.silu_and_mul where the Triton backend runs (triton_layers.py)
    kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class ClampedSiluAndMul(nn.Module):
    """[.., 2I] (gate | up) -> silu(min(gate, L)) * clamp(up, -L, L) [.., I]: the SwiGLU clamped at
    swiglu_limit L (DeepSeek-V4, Hy-V4, GLM-5.3-Flash); `after_silu`: min(silu(gate), L) instead
    (Ling's experts)."""

    def __init__(self, limit: float, after_silu: bool = False) -> None:
        super().__init__()
        self.limit, self.after_silu = limit, after_silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        limit = self.limit
        act = F.silu(gate).clamp(max=limit) if self.after_silu else F.silu(gate.clamp(max=limit))
        return act * up.clamp(min=-limit, max=limit)


class ActAndMul(nn.Module):
    """x: [T, 2*I] holding (gate | up) -> act(gate) * up: [T, I], for a gated MLP whose config
    names another activation than SiLU (SiluAndMul keeps SiLU's fused kernel)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


class GELU(nn.Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)


class FastGELU(nn.Module):
    """The sigmoid-free tanh approximation used by `gelu_fast`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): CLIP's and some GPT-NeoX configs' `quick_gelu`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class ReLUSquared(nn.Module):
    """relu(x)^2: `relu2` (Nemotron, Primer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))


class XIELU(nn.Module):
    """xIELU (Apertus; arXiv:2411.13010), elementwise with learned scalars a_p, a_n:

        alpha_p = softplus(a_p)                alpha_n = beta + softplus(a_n)
        y = alpha_p * x^2 + beta * x                                  x > 0
        y = alpha_n * (expm1(min(x, eps)) - x) + beta * x             x <= 0

    The four scalars are checkpoint weights (HF's `act_fn.alpha_p` / `alpha_n` [1] and its
    persistent buffers `beta` / `eps` [], loaded as parameters here), defaults a_p =
    softplus^-1(0.8), a_n = softplus^-1(0.8 - beta), beta 0.5, eps -1e-6. Computed in x's dtype
    with the scalars in the model's, in HF's order (its Python path; the optional CUDA kernel
    is the same function).
    """

    def __init__(
        self, alpha_p: float = 0.8, alpha_n: float = 0.8, beta: float = 0.5, eps: float = -1e-6
    ) -> None:
        super().__init__()
        self._init_values = (alpha_p, alpha_n, beta, eps)
        self.alpha_p = nn.Parameter(torch.empty(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.empty(1), requires_grad=False)
        self.beta = nn.Parameter(torch.empty(()), requires_grad=False)
        self.eps = nn.Parameter(torch.empty(()), requires_grad=False)
        for p in (self.alpha_p, self.alpha_n, self.beta, self.eps):
            p.dummy_init = self._defaults  # (loader.init_dummy_weights) not a norm's 1.0
        self._defaults()

    @torch.no_grad()
    def _defaults(self, param: nn.Parameter | None = None, gen=None) -> None:
        """HF's initial values (each parameter's own, whichever `param` asks)."""
        alpha_p, alpha_n, beta, eps = self._init_values
        inv_softplus = lambda y: math.log(math.expm1(y))
        self.alpha_p.fill_(inv_softplus(alpha_p))
        self.alpha_n.fill_(inv_softplus(alpha_n - beta))
        self.beta.fill_(beta)
        self.eps.fill_(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        beta_x = self.beta * x
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + beta_x
        return torch.where(x > 0, alpha_p * x * x + beta_x, negative)


_ACTIVATIONS: dict[str, type[nn.Module] | tuple[type[nn.Module], dict]] = {
    "gelu": GELU,
    "gelu_new": (GELU, {"approximate": "tanh"}),
    "gelu_pytorch_tanh": (GELU, {"approximate": "tanh"}),
    "gelu_fast": FastGELU,
    "quick_gelu": QuickGELU,
    "relu": nn.ReLU,
    "relu2": ReLUSquared,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "xielu": XIELU,
}


def get_act_fn(name: str, field: str = "hidden_act") -> nn.Module:
    """Elementwise activation by its HF config name; `field` (the config key it came from:
    `hidden_act`, `activation_function`, ...) names the culprit in the ValueError."""
    entry = _ACTIVATIONS.get(name.lower())
    if entry is None:
        raise ValueError(
            f"config.{field}={name!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
        )
    if isinstance(entry, tuple):
        cls, kwargs = entry
        return cls(**kwargs)
    return entry()
