"""Public classes defined in private modules, named after the public one.

A package split by concern (``gpucx.aio``, ``gpucx.ops.am``,
``gpucx.mem.cuda``) defines its classes in private modules and re-exports
them.  :func:`rehome` makes such a class, and every function and property
of its own, read as the public module's: ``repr``, pickling, error
messages, and the API reference (mkdocstrings imports gpucx; a method
whose ``__module__`` names the private module while its class names the
public one reads there as an alias of itself, and the build fails).
"""

from __future__ import annotations

__all__ = ["rehome"]


def rehome(module: str, *classes: type) -> None:
    """Name each of ``classes`` and its own functions and properties after
    ``module`` (where they were named after a module below it)."""
    for cls in classes:
        below = cls.__module__
        cls.__module__ = module
        for attr in vars(cls).values():
            fget = getattr(attr, "fget", None)
            for f in (attr, fget, getattr(attr, "__func__", None)):
                if f is not None and getattr(f, "__module__", None) == below:
                    try:
                        f.__module__ = module
                    except (AttributeError, TypeError):  # a builtin's
                        pass
