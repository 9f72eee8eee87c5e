"""The releases of a dependency the library's calls into it were checked on, and the refusal of any other at
apply time: the one version lookup (``installed``) and the one range (``CheckedRange``) every version check uses.
``TILED_MLP_UNCHECKED_VERSIONS`` (package names, or ``all``) turns a refusal into a warning, at the user's risk."""
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
    """The installed version of ``package`` (None where it is not installed); read once per process."""
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
    parsed = _parsed(version)
    return () if parsed is None else parsed.release


@dataclass(frozen=True)
class CheckedRange:
    package: str  # the distribution's name, as pip knows it
    oldest: str
    newest: Optional[str] = None  # its minor series is inside, a later one not; None: every later release is
    exact: bool = False  # only releases from oldest to newest themselves (a local build ``+cpu`` counts)

    def contains(self, version: Optional[str]) -> bool:
        parsed = None if version is None else _parsed(version)
        if parsed is None:
            return False
        if self.exact:
            return _parsed(self.oldest) <= _parsed(parsed.public) <= _parsed(self.newest or self.oldest)
        if parsed.release < _release(self.oldest):
            return False
        return self.newest is None or parsed.release[:2] <= _release(self.newest)[:2]

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
        if self.newest is None:
            return f"{self.package}>={self.oldest}"
        major, minor = _release(self.newest)[:2]
        return f"{self.package}>={self.oldest},<{major}.{minor + 1}"


def checked_on(package: str, releases: Tuple[str, ...], exact: bool = False) -> Tuple[CheckedRange, ...]:
    """Each of ``releases`` as a range of its own: the release alone (``exact``), else its minor series from it."""
    return tuple(CheckedRange(package, release, release, exact) for release in releases)


def in_any(ranges: Tuple[CheckedRange, ...], version: Optional[str]) -> bool:
    return any(checked.contains(version) for checked in ranges)


def unchecked_allowed(package: str) -> bool:
    allowed = {name.strip().lower() for name in os.environ.get(UNCHECKED_ENV, "").split(",")}
    return package.lower() in allowed or "all" in allowed


def require(checked: CheckedRange, feature: str) -> str:
    """The installed version of ``checked.package``; refused (``UncheckedVersionError``) outside the range,
    unless ``TILED_MLP_UNCHECKED_VERSIONS`` names the package (then a warning, once per process)."""
    version = installed(checked.package)
    if checked.contains(version):
        return str(version)
    if version is None:
        raise UncheckedVersionError(f"{feature} needs {checked.package}, which is not installed (checked on "
                                    f"{checked.describe()})")
    why = (f"{feature} calls internals of {checked.package} that were checked on {checked.describe()}; "
           f"{checked.package} {version} is installed. Install a release in that range "
           f"(pip install '{checked.pip_requirement()}'), or set {UNCHECKED_ENV}={checked.package} to run on "
           f"{version} unchecked, at your own risk")
    if not unchecked_allowed(checked.package):
        raise UncheckedVersionError(why)
    _warn_once(why)
    return version


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(f"{message} (allowed by {UNCHECKED_ENV})", stacklevel=3)
