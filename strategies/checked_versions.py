"""The releases of a dependency that the library's calls into it were checked on, and the refusal of any other at
apply time: the one version lookup (``installed``), the one parser and the one range (``CheckedRange``) that every
version check of the library uses (the seams into other libraries' internals, the framework entry points'
``CheckedFramework``, ZeRO-3's and HF tensor parallelism's checks here in ``strategies``).

A range names its oldest and newest checked releases. By default a patch release of the newest minor series is
inside it (patch releases keep internals) and a newer minor series is not; ``exact`` ranges hold only the
releases named (a framework's entry point relies on when the framework calls it, which a patch may change);
a range without ``newest`` holds every later release. ``TILED_MLP_UNCHECKED_VERSIONS`` (a comma-separated list of
package names, or ``all``) turns a refusal into a warning for those packages: for trying a new release before
this library has been checked on it, at the user's risk.
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


@functools.cache
def installed(package: str) -> Optional[str]:
    """The installed version of the distribution ``package`` (None where it is not installed); read once per
    process (a lookup reads the environment's metadata: about 0.25 ms)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _parsed(version: str):
    """``version`` as a ``packaging`` Version (None for a string that is no version, such as "unknown")."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version)
    except InvalidVersion:
        return None


def _release(version: str) -> Tuple[int, ...]:
    """The numeric release of ``version`` (``"5.25.0"`` -> (5, 25, 0); ``"2.13.0+cpu"``, ``"5.26.0.dev0"``
    -> their numeric part; () for no version)."""
    parsed = _parsed(version)
    return () if parsed is None else parsed.release


@dataclass(frozen=True)
class CheckedRange:
    package: str  # the distribution's name, as pip knows it
    oldest: str  # the oldest release the calls were checked on
    newest: Optional[str] = None  # the newest one (None: every later release counts as checked)
    exact: bool = False  # True: only releases from oldest to newest themselves (a local build ``+cpu`` counts)

    def contains(self, version: Optional[str]) -> bool:
        parsed = None if version is None else _parsed(version)
        if parsed is None:
            return False
        if self.exact:
            return _parsed(self.oldest) <= _parsed(parsed.public) <= _parsed(self.newest or self.oldest)
        release = parsed.release
        if release < _release(self.oldest):
            return False
        return self.newest is None or release[:2] <= _release(self.newest)[:2]

    def describe(self) -> str:
        if self.exact:
            return f"{self.package} {self.oldest}" + (f" to {self.newest}" if self.newest not in (None, self.oldest) else "")
        if self.newest is None:
            return f"{self.package} >= {self.oldest}"
        newest = ".".join(str(n) for n in _release(self.newest)[:2])
        return f"{self.package} {self.oldest} to {newest}.x"

    def pip_requirement(self) -> str:
        if self.exact and self.newest in (None, self.oldest):
            return f"{self.package}=={self.oldest}"
        below = "" if self.newest is None else f",<{_next_minor(self.newest)}"
        return f"{self.package}>={self.oldest}{below}"


def checked_on(package: str, releases: Tuple[str, ...], exact: bool = False) -> Tuple[CheckedRange, ...]:
    """Each of ``releases`` as a range of its own: the release alone (``exact``), else its minor series from it."""
    return tuple(CheckedRange(package, release, release, exact) for release in releases)


def in_any(ranges: Tuple[CheckedRange, ...], version: Optional[str]) -> bool:
    return any(checked.contains(version) for checked in ranges)


def unchecked_allowed(package: str) -> bool:
    """``TILED_MLP_UNCHECKED_VERSIONS`` names ``package`` (or ``all``)."""
    allowed = {name.strip().lower() for name in os.environ.get(UNCHECKED_ENV, "").split(",")}
    return package.lower() in allowed or "all" in allowed


def refusal(checked: CheckedRange, version: Optional[str], feature: str) -> str:
    """Why ``feature`` cannot run on ``version`` of ``checked.package`` ('' when it can)."""
    if version is None:
        return f"{feature} needs {checked.package}, which is not installed (checked on {checked.describe()})"
    if checked.contains(version):
        return ""
    return (f"{feature} calls internals of {checked.package} that were checked on {checked.describe()}; "
            f"{checked.package} {version} is installed. Install a release in that range "
            f"(pip install '{checked.pip_requirement()}'), or set {UNCHECKED_ENV}={checked.package} to run on {version} unchecked, at your own risk")


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
    if version is not None and unchecked_allowed(checked.package):
        _warn_once(why)
        return version
    raise UncheckedVersionError(why)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(f"{message} (allowed by {UNCHECKED_ENV})", stacklevel=3)
