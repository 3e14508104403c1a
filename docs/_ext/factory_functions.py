"""A griffe extension: document functions that a factory makes as the functions they are.

Static analysis sees `get_act_patch_resid_pre = _sweep_function(...)` as a module
attribute with no docstring. For every such attribute whose value is a call and whose
runtime value is a function, this extension imports the module and replaces the
attribute with the function as inspected at runtime: its signature, annotations and
docstring. Everything else keeps its static analysis.
"""

from __future__ import annotations

import inspect
from typing import Any

import griffe


class FactoryFunctions(griffe.Extension):
    """Replace call-made module attributes that are functions at runtime by those functions."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for module in _modules(pkg):
            made = [
                name
                for name, member in module.members.items()
                if not member.is_alias
                and member.is_attribute
                and isinstance(member.value, griffe.ExprCall)
            ]
            if not made:
                continue
            runtime = griffe.dynamic_import(module.path)
            functions = [name for name in made if inspect.isfunction(getattr(runtime, name, None))]
            if not functions:
                continue
            inspected = griffe.inspect(module.path)
            style = module.docstring  # parse as the module's own docstring is parsed
            for name in functions:
                function = inspected[name]
                function.docstring = griffe.Docstring(
                    inspect.cleandoc(getattr(runtime, name).__doc__ or ""),
                    parser=style.parser if style else None,
                    parser_options=style.parser_options if style else None,
                )
                module.set_member(name, function)


def _modules(module: griffe.Module) -> list[griffe.Module]:
    found = [module]
    for member in module.modules.values():
        if not member.is_alias:
            found += _modules(member)
    return found
