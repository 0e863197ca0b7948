"""What a model looks like after loading: swapped modules, where its parameters live, what is quantized."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from ._hf.active import swapped_modules
from .quantized import is_quantized_linear
from .registry import enabled_records
from .swaps.quant import LinearExperts


@dataclass(frozen=True)
class Report:
    """Parameter counts are logical (a 4-bit weight of 64x64 counts 4096), so shares compare across dtypes."""

    swapped: dict[str, int]
    linear_params: int
    other_params: int
    quantized_params: int
    expert_params: int
    expert_linear_params: int
    expert_quantized_params: int
    footprint_bytes: int
    warnings: tuple[str, ...] = field(default=())

    @property
    def total_params(self) -> int:
        return self.linear_params + self.other_params

    @property
    def linear_share(self) -> float:
        """Share of all parameters that sit in (possibly quantized) linear layers, i.e. that quantizers see."""
        return self.linear_params / self.total_params if self.total_params else 0.0

    @property
    def quantized_share(self) -> float:
        return self.quantized_params / self.total_params if self.total_params else 0.0

    @property
    def expert_linear_share(self) -> float:
        """Share of the expert parameters in linear layers: 1.0 under a '-quant' bundle, 0.0 for stock experts."""
        return self.expert_linear_params / self.expert_params if self.expert_params else 0.0

    @property
    def expert_quantized_share(self) -> float:
        return self.expert_quantized_params / self.expert_params if self.expert_params else 0.0

    def __str__(self) -> str:
        swapped = ", ".join(f"{name} x{count}" for name, count in sorted(self.swapped.items())) or "nothing"
        lines = [
            f"swapped modules       {swapped}",
            f"parameters            {self.total_params:,}",
            f"  in linear layers    {self.linear_params:,} ({self.linear_share:.1%})",
            f"  quantized           {self.quantized_params:,} ({self.quantized_share:.1%})",
            f"expert parameters     {self.expert_params:,}",
            f"  in linear layers    {self.expert_linear_params:,}",
            f"  quantized           {self.expert_quantized_params:,} ({self.expert_quantized_share:.1%})",
            f"weight footprint      {self.footprint_bytes / 2**20:,.2f} MiB",
        ]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_quantized_linear(module)


def _logical_linear_params(module: nn.Module) -> int:
    in_features, out_features = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if in_features is None or out_features is None:
        return sum(p.numel() for p in module.parameters(recurse=False))
    bias = getattr(module, "bias", None)
    return in_features * out_features + (bias.numel() if bias is not None else 0)


def _is_stock_experts(module: nn.Module) -> bool:
    """A stock Experts module holding its experts as stacked tensors (gate_up_proj, up_proj, dbrx's mlp.w1), not as
    linear layers a quantizer sees."""
    if isinstance(module, LinearExperts) or not type(module).__name__.endswith("Experts"):
        return False
    return not any(_is_linear(m) for m in module.modules()) and any(p.dim() >= 2 for p in module.parameters())


def report(model: nn.Module) -> Report:
    """Count where `model`'s parameters are: linear or not, quantized or not, expert or not."""
    swapped = Counter(type(m)._layerswap_original.__name__ for _, m in swapped_modules(model))
    linear = other = quantized = experts = experts_linear = experts_quantized = 0
    expert_linear_ids = {
        id(m) for module in model.modules() if isinstance(module, LinearExperts) for m in module.modules()
    }
    stock_expert_ids = {
        id(m) for module in model.modules() if _is_stock_experts(module) for m in module.modules()
    }
    for module in model.modules():
        if _is_linear(module):
            count = _logical_linear_params(module)
            linear += count
            is_quantized = is_quantized_linear(module)
            quantized += count if is_quantized else 0
            if id(module) in expert_linear_ids:
                experts += count
                experts_linear += count
                experts_quantized += count if is_quantized else 0
            continue
        own = sum(p.numel() for p in module.parameters(recurse=False))
        other += own
        if id(module) in stock_expert_ids:
            experts += own
    footprint = sum(p.numel() * p.element_size() for p in model.parameters())
    footprint += sum(b.numel() * b.element_size() for b in model.buffers())
    warnings = []
    swapped_classes = {type(m) for _, m in swapped_modules(model)}
    for record in enabled_records():
        if record.replacements and not swapped_classes & record.replacements:
            warnings.append(f"enabled bundle {record.bundle.name!r} swapped nothing in this model")
    if experts and experts_quantized == 0 and quantized:
        warnings.append(
            "the model is quantized but none of its expert parameters are: enable the family's '-quant' bundle"
        )
    return Report(
        swapped=dict(swapped),
        linear_params=linear,
        other_params=other,
        quantized_params=quantized,
        expert_params=experts,
        expert_linear_params=experts_linear,
        expert_quantized_params=experts_quantized,
        footprint_bytes=footprint,
        warnings=tuple(warnings),
    )
