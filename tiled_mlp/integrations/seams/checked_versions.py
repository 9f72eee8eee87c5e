"""The releases of a dependency the stack's calls into its internals were checked on, and the refusal of
any other at apply time.

A range names its oldest and newest checked releases; a patch release of the newest minor series is
inside it (patch releases keep internals), a newer minor series is not. ``TILED_MLP_UNCHECKED_VERSIONS``
(a comma-separated list of package names, or ``all``) turns a refusal into a warning for those
packages: for trying a new release before this library has been checked on it, at the user's risk.
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Optional, Tuple

UNCHECKED_ENV = "TILED_MLP_UNCHECKED_VERSIONS"


class UncheckedVersionError(RuntimeError):
    """An installed dependency is outside the releases the stack's calls into it were checked on."""


def _release(version: str) -> Tuple[int, ...]:
    """The numeric release of ``version`` (``"5.25.0"`` -> (5, 25, 0); ``"2.13.0+cpu"``, ``"5.26.0.dev0"``
    -> their numeric part)."""
    from packaging.version import Version

    return Version(version).release


@dataclass(frozen=True)
class CheckedRange:
    package: str  # the distribution's name, as pip knows it
    oldest: str  # the oldest release the calls were checked on
    newest: str  # the newest one; later patch releases of its minor series count as checked

    def contains(self, version: str) -> bool:
        release = _release(version)
        return _release(self.oldest) <= release and release[:2] <= _release(self.newest)[:2]

    def describe(self) -> str:
        newest = ".".join(str(n) for n in _release(self.newest)[:2])
        return f"{self.package} {self.oldest} to {newest}.x"


def installed(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def refusal(checked: CheckedRange, version: Optional[str], feature: str) -> str:
    """Why ``feature`` cannot run on ``version`` of ``checked.package`` ('' when it can)."""
    if version is None:
        return f"{feature} needs {checked.package}, which is not installed (checked on {checked.describe()})"
    if checked.contains(version):
        return ""
    return (f"{feature} calls internals of {checked.package} that were checked on {checked.describe()}; "
            f"{checked.package} {version} is installed. Install a release in that range "
            f"(pip install '{checked.package}>={checked.oldest},<{_next_minor(checked.newest)}'), or set "
            f"{UNCHECKED_ENV}={checked.package} to run on {version} unchecked, at your own risk")


def _next_minor(version: str) -> str:
    major, minor = _release(version)[:2]
    return f"{major}.{minor + 1}"


def require(checked: CheckedRange, feature: str) -> str:
    """The installed version of ``checked.package``; refused (``UncheckedVersionError``) outside the range,
    unless ``TILED_MLP_UNCHECKED_VERSIONS`` names the package (then a warning, once per process)."""
    version = installed(checked.package)
    why = refusal(checked, version, feature)
    if not why:
        return str(version)
    allowed = {name.strip().lower() for name in os.environ.get(UNCHECKED_ENV, "").split(",")}
    if version is not None and (checked.package.lower() in allowed or "all" in allowed):
        _warn_once(why)
        return version
    raise UncheckedVersionError(why)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(f"{message} (allowed by {UNCHECKED_ENV})", stacklevel=3)
