"""The table of worst errors the kernel tests print at the end of their module (with -s),
so that a tolerance's margin can be read off a run."""

from __future__ import annotations


def print_max_errors(title: str, max_err: dict[str, float | tuple[float, ...]], width: int):
    """``title``, then one row a key (sorted, padded to ``width``): its error or errors."""
    print(f"\n{title}")
    for key in sorted(max_err):
        errors = max_err[key] if isinstance(max_err[key], tuple) else (max_err[key],)
        print(f"  {key:<{width}} " + "  ".join(f"{e:.3e}" for e in errors))
