"""The MoE families of the installed transformers, found in its own modeling code.

Every model type transformers registers has a modeling module; those that define an Experts class (a class named
`*Experts`) are MoE families. What each one declares is read from its source, without importing it (reading the
74 of transformers 5.24 took 0.12 s, warm cache): the experts class, whether it is decorated with
`@use_experts_implementation` and with which layout arguments, its router class and its attention class. A family whose experts declare the stock fused
layout (decorated, no layout argument off its default) is one the standard swaps serve with no code change.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

from ..bundle import ExpertsFlags
from .experts import STOCK_LAYOUT_FLAGS

_EXPERTS = re.compile(
    r"^(?P<decorator>@use_experts_implementation(?:\((?P<arguments>[^)]*)\))?\n)?class (?P<name>\w*Experts)\(",
    re.M,
)
_CLASS = re.compile(r"^class (\w+)\(", re.M)
_NEXT_TOP_LEVEL = re.compile(r"^(?:class |@|def )", re.M)
_ROUTER = re.compile(r"^class (?P<name>\w*(?:Router|Gate))\(nn\.Module\):", re.M)
_ATTENTION = re.compile(
    r"^class (?P<name>\w*Attention)\(nn\.Module\):(?P<body>.*?)(?=^class |\Z)", re.M | re.S
)


@dataclass(frozen=True)
class ExpertsDeclaration:
    """One Experts class as its modeling module declares it."""

    name: str
    decorated: bool  # by @use_experts_implementation
    layout: tuple[tuple[str, str], ...]  # its layout arguments as written, e.g. (("is_transposed", "True"),)
    own_gate: bool  # defines its own `_apply_gate` (a clamped or otherwise changed act(gate) * up)

    @property
    def is_stock_layout(self) -> bool:
        """Decorated, with every layout argument at its stock value (its gate may be its own)."""
        stock = {flag: str(value) for flag, (value, _) in STOCK_LAYOUT_FLAGS.items()}
        return self.decorated and all(stock.get(flag) == value for flag, value in self.layout)

    @property
    def flags(self) -> ExpertsFlags | None:
        """Its layout as ExpertsFlags; None where it is undecorated or declares a flag ExpertsFlags lacks (a
        post-expert norm) or a value that is not a plain True/False."""
        known = {f.name for f in dataclasses.fields(ExpertsFlags)}
        if not self.decorated or any(k not in known or v not in ("True", "False") for k, v in self.layout):
            return None
        return ExpertsFlags.of({k: v == "True" for k, v in self.layout})


@dataclass(frozen=True)
class DiscoveredFamily:
    """A modeling module of the installed transformers that defines Experts classes."""

    module_name: str  # e.g. "qwen3_5_moe"
    model_types: tuple[str, ...]  # every model type whose config lives in it, the module's own name first
    experts: tuple[ExpertsDeclaration, ...]
    routers: tuple[str, ...]  # classes named *Router / *Gate
    attentions: tuple[str, ...]  # attention classes that assign separate q_proj, k_proj and v_proj
    classes: tuple[str, ...] = ()  # every top-level class the module defines
    # Each router's forward body as written, comments and blank lines dropped (router_forwards compares them).
    router_bodies: tuple[tuple[str, str], ...] = ()

    @property
    def modeling_module(self) -> str:
        return f"transformers.models.{self.module_name}.modeling_{self.module_name.rsplit('.', 1)[-1]}"

    @property
    def model_type(self) -> str:
        return self.model_types[0]


def _declarations(source: str) -> tuple[ExpertsDeclaration, ...]:
    found = []
    for match in _EXPERTS.finditer(source):
        arguments = [a.strip() for a in (match["arguments"] or "").split(",") if a.strip()]
        layout = tuple(tuple(part.strip() for part in a.split("=", 1)) for a in arguments if "=" in a)
        end = _NEXT_TOP_LEVEL.search(source, match.end())
        body = source[match.end() : end.start() if end else len(source)]
        own_gate = "def _apply_gate(" in body
        found.append(ExpertsDeclaration(match["name"], match["decorator"] is not None, layout, own_gate))
    return tuple(found)


_COMMENT = re.compile(r"\s+#.*$|^\s*#.*$", re.M)


def _forward_body(source: str, class_name: str) -> str | None:
    """The body of `class_name`'s forward in `source`, without its signature, comments and blank lines, each line
    dedented: two routers with the same body compute the same thing from attributes of the same names."""
    start = re.search(rf"^class {re.escape(class_name)}\(", source, re.M)
    if start is None:
        return None
    end = _NEXT_TOP_LEVEL.search(source, start.end())
    body = source[start.end() : end.start() if end else len(source)]
    forward = re.search(
        r"^    def forward\(.*?\).*?:\n(?P<body>(?:^(?:        .*|\s*)\n)*)", body, re.M | re.S
    )
    if forward is None:
        return None
    lines = textwrap.dedent(_COMMENT.sub("", forward["body"])).splitlines()
    return "\n".join(line.rstrip() for line in lines if line.strip())


def router_forwards() -> dict[str, str]:
    """Every router class of the installed transformers' MoE families -> its forward body (see _forward_body)."""
    return {name: body for found in discover() for name, body in found.router_bodies}


def _separate_qkv(body: str) -> bool:
    return all(re.search(rf"self\.{p} = nn\.Linear\(", body) for p in ("q_proj", "k_proj", "v_proj"))


@functools.cache
def discover() -> tuple[DiscoveredFamily, ...]:
    """Every modeling module of the installed transformers with an Experts class, by module name."""
    root = Path(transformers.__file__).parent / "models"
    by_module: dict[str, list[str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        by_module.setdefault(model_type_to_module_name(model_type), []).append(model_type)
    families = []
    for module_name, model_types in sorted(by_module.items()):
        leaf = module_name.rsplit(".", 1)[-1]
        path = root.joinpath(*module_name.split(".")) / f"modeling_{leaf}.py"
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if b"Experts(" not in data:
            continue
        source = data.decode()
        experts = _declarations(source)
        if not experts:
            continue
        model_types.sort(key=lambda t: (t != leaf, t))
        routers = tuple(m["name"] for m in _ROUTER.finditer(source))
        families.append(
            DiscoveredFamily(
                module_name=module_name,
                model_types=tuple(model_types),
                experts=experts,
                routers=routers,
                router_bodies=tuple(
                    (name, body) for name in routers if (body := _forward_body(source, name)) is not None
                ),
                attentions=tuple(m["name"] for m in _ATTENTION.finditer(source) if _separate_qkv(m["body"])),
                classes=tuple(_CLASS.findall(source)),
            )
        )
    return tuple(families)
